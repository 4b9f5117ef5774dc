"""`tracetrain tune`: close the loop from profile to advice to a faster config, measured.

The package itself is callable, as `tracetrain.train` is, so the Python API reads as the command does:

    import tracetrain
    result = tracetrain.tune("my.toml", budget_min=10)   # tracetrain.tune.api.tune

| module     | what it holds                                                                   |
|------------|---------------------------------------------------------------------------------|
| space.py   | candidates: the profile's advice and the planner's what-ifs as config changes    |
| trial.py   | one trial: `tracetrain train` in its own process over a fixed window, measured   |
| ledger.py  | finished trials on disk (tune/trials.jsonl): a rerun skips them                  |
| session.py | the loop: baseline, candidates, numerics guard, winners combined, budget, Ctrl-C |
| output.py  | tuned.toml: the user's config plus only the changed keys, each with its gain     |
| report.py  | tune/report.html: every trial, predicted against measured                        |
| api.py     | `tune(config, ...)`, what the command calls                                      |
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from tracetrain.tune.api import tune

        return tune(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
