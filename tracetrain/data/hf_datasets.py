"""`hf:NAME` data paths: a Hugging Face dataset read from this machine's cache, never from the network.

    data.path = "hf:tatsu-lab/alpaca"           the "train" split (data.split)
    data.path = "hf:openai/gsm8k:main"          a named config
    [[data.sources]] path = "hf:NAME", split = "test"

Two caches can hold a dataset, and both are tried, offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set
for the load, and the Hub library is asked for local files only):

1. the `datasets` cache (`$HF_HOME/datasets`), which `datasets.load_dataset(NAME)` fills when run once
   on a machine with internet: `load_dataset(NAME)` offline finds the prepared Arrow files there;
2. the Hub cache (`$HF_HOME/hub`), which `huggingface-cli download --repo-type dataset NAME` fills
   (and `load_dataset` too): the snapshot folder of raw files is found with `snapshot_download(...,
   local_files_only=True)` and read by `load_dataset(folder)`, which prepares it once into cache 1.

A dataset in neither is one line that says how to get it. The rows are then read from the loaded
dataset's memory-mapped Arrow table, like any other rows (files.py); the cache key of the tokenised rows
(token_cache.py) hashes the dataset's Arrow files, so an updated dataset is never mistaken for the old one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from tracetrain.errors import DataError

PREFIX = "hf:"
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def is_hf(path: str) -> bool:
    """Does a data path name a Hugging Face dataset (`hf:NAME[:CONFIG]`)?"""
    return path.startswith(PREFIX)


def parse_hf(path: str) -> tuple[str, str | None]:
    """'hf:owner/name:config' -> ('owner/name', 'config'); no config -> None."""
    name, _, config = path[len(PREFIX) :].partition(":")
    return name, config or None


def _how_to_get(name: str) -> str:
    return (
        f"on a machine with internet run `python -c \"import datasets; datasets.load_dataset('{name}')\"` "
        f"or `huggingface-cli download --repo-type dataset {name}`, and copy the cache ($HF_HOME, default "
        "~/.cache/huggingface) here"
    )


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No network during the load. The libraries read these variables once, at import: set both the
    variables (for a first import) and the imported flags, and restore them afterwards."""
    import datasets
    import huggingface_hub.constants as hub_constants

    saved_env = {k: os.environ.get(k) for k in _OFFLINE_VARS}
    saved_flags = (datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE)
    os.environ.update(dict.fromkeys(_OFFLINE_VARS, "1"))
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved_flags
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _quiet() -> None:
    """The libraries' progress bars and cache notices would interleave with ours."""
    import datasets

    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def load_hf_dataset(path: str, split: str, key: str) -> Any:
    """The `split` of the dataset `path` names, from the local cache; DataError (one line) when it is not there."""
    name, config = parse_hf(path)
    try:
        import datasets
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DataError(f"{path} (config key '{key}'): reading hf: datasets needs `pip install datasets`") from None
    _quiet()
    with _offline():
        try:
            return datasets.load_dataset(name, config, split=split)
        except (ConnectionError, OSError, ValueError) as e:  # not prepared in the datasets cache, or not so
            prepared_error = e
        try:
            folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
        except (OSError, ValueError):
            if isinstance(prepared_error, ValueError):  # found, but not that split or config
                raise DataError(f"{path} (config key '{key}'): {_first_line(prepared_error)}") from None
            raise DataError(
                f"{path} (config key '{key}'): dataset {name!r} is not in the local Hugging Face cache "
                f"and is read offline; {_how_to_get(name)}"
            ) from None
        try:
            return datasets.load_dataset(folder, config, split=split)
        except (OSError, ValueError) as e:
            raise DataError(f"{path} (config key '{key}'): {_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def hf_batches(path: str, split: str, key: str) -> tuple[Iterator[Any], int]:
    """(the dataset's Arrow record batches, its number of rows), for files.py's row readers."""
    ds = load_hf_dataset(path, split, key)
    return iter(ds.data.to_batches()), ds.num_rows


def hf_files(path: str, split: str, key: str) -> list[str]:
    """The Arrow files holding the split: what the token cache hashes for its key."""
    return sorted({f["filename"] for f in load_hf_dataset(path, split, key).cache_files})
