"""torch.autocast as Megatron's linear Function meets it (``config.enable_autocast``, or a user's own).

Megatron's ``LinearWithGradAccumulationAndAsyncCommunication`` is ``custom_fwd`` / ``custom_bwd``: its
``torch.matmul`` calls run under the caller's autocast, and its backward under the forward's. Autocast
casts a matmul's floating operands (not float64) to the autocast dtype, so the output, the dgrad and
the non-fused wgrad come out in that dtype and the collectives after them carry its bytes; the input
all-gathers and the fused wgrad kernel's operands stay in the tensors' own dtypes (autocast does not
touch a collective or apex's kernel). CoC's Functions write into preallocated buffers with
``matmul(out=...)``, which autocast does not cast: they read the dtype here once per forward, keep it
for their backward, and cast the operands themselves.
"""

from __future__ import annotations

import torch


def compute_dtype(tensor: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast gives a matmul of ``tensor`` now, or None when autocast is off on its device."""
    device_type = tensor.device.type
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    except RuntimeError:  # a device type this torch cannot autocast
        return None


def operand(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as autocast hands it to a matmul: cast to ``dtype`` if floating and not float64."""
    if dtype is None or tensor.dtype == dtype or not tensor.is_floating_point() or tensor.dtype == torch.float64:
        return tensor
    return tensor.to(dtype)


def result_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of a matmul output (or a dgrad) of ``tensor`` under ``dtype`` (None: autocast off)."""
    return tensor.dtype if dtype is None else dtype


def seen_as(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor of ``tensor``'s shape and device in the dtype autocast would give it, without copying its
    data (for checks that read dtype, shape and device only: a fused backend's limits)."""
    if operand(tensor, dtype) is tensor:
        return tensor
    return torch.empty((), dtype=dtype, device=tensor.device).expand(tensor.shape)
