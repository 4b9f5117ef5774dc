"""The event kinds and the column table every trace reader fills (trace.py for Kineto JSON, nsys.py for
Nsight Systems exports) and every analyzer reads: one home, below the readers and the launch linker
(link.py), so none of them imports another for a constant."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Host event kinds and GPU event kinds (the `kind` column).
OP, ANNOTATION, RUNTIME = 0, 1, 2
KERNEL, MEMCPY, MEMSET = 0, 1, 2
GPU_KIND_NAMES = ("kernel", "memcpy", "memset")


@dataclass(frozen=True)
class Columns:
    """Named equal-length numpy columns, one row per event."""

    data: dict[str, np.ndarray]

    def __getattr__(self, key: str) -> np.ndarray:
        if key.startswith("__") or key == "data":  # copy/pickle probe before `data` exists
            raise AttributeError(key)
        try:
            return self.data[key]
        except KeyError:
            raise AttributeError(key) from None

    def __len__(self) -> int:
        return len(next(iter(self.data.values())))
