"""tracetrain: train and fine-tune Llama-family models fast, and see where time and memory go.

`tracetrain.train(config, data=..., callbacks=[...])` trains from Python (tracetrain/train/api.py),
`tracetrain.tune(config, ...)` tunes a config by measuring candidates (tracetrain/tune/api.py); the
command line is `tracetrain train|eval|generate|export|data|profile|analyze|plan|tune ...` (cli.py).
"""

from tracetrain import (
    train,  # the training package, callable as the Python API (train/__init__.py)
    tune,  # the tuner, callable the same way (tune/__init__.py)
)

__version__ = "0.1.0"
__all__ = ["__version__", "train", "tune"]
