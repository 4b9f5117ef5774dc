"""Memory transforms over the plain model: activation recomputation and activation offload (and the
optimizer offload in `optimizer_offload`). Each is an `apply_*` function called from `models.build`."""

from tracetrain.memory.activation_offload import ActivationOffload, apply_activation_offload
from tracetrain.memory.recompute import apply_recompute

__all__ = ["ActivationOffload", "apply_activation_offload", "apply_recompute"]
