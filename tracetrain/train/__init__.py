"""Training: the loop, its spec and assembly, the step, checkpoints, metrics.

The package itself is callable, so that the Python API reads as the command line does:

    import tracetrain
    result = tracetrain.train("configs/chat-lora.toml", data=rows, callbacks=[MyCallback()])

(`tracetrain.train(...)` is `tracetrain.train.api.train(...)`; see its docstring.)
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tracetrain.train.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
