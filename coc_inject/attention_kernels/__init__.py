"""Block attention kernels with a log-sum-exp: the one interface every attention schedule calls,
one backend per device behind it (PyTorch's SDPA dispatch is the model).

A kernel attends a query block to one key/value block::

    forward(q, k, v, scale, causal)                    -> (out, lse)
    backward(dout, q, k, v, out, lse, scale, causal)   -> (dq, dk, dv)

q ``[B, H, Sq, D]``; k, v ``[B, G, Sk, D]`` with G dividing H (grouped-query attention: query head
h reads key/value head ``h // (H/G)``, never a repeated copy where the kernel takes G < H); ``out``
in q's dtype, ``lse`` fp32 ``[B, H, Sq]``. ``causal``: a diagonal block (Sq == Sk), query i sees
keys 0..i. Backward takes the FINAL merged ``out`` and ``lse`` of its queries (over every key block),
as ring-flash-attention passes them to each block's flash backward: the block's probabilities are
``exp(scores - lse)`` exactly, and ``rowsum(dout * out)`` is the softmax term of the whole row.
Gradients come back in the inputs' dtypes (dk, dv with G heads).

Backends (one module each): ``cpu`` (torch's fused CPU flash kernel), ``cuda`` (SDPA's flash and
memory-efficient kernels), ``npu`` (``torch_npu.npu_fusion_attention``), ``reference`` (tiled fp32
torch ops: the test oracle, and the fallback where no fused kernel can run a call).
"""

from __future__ import annotations

from dataclasses import dataclass

AUTO, FUSED, REFERENCE = "auto", "fused", "reference"
PREFERENCES = (AUTO, FUSED, REFERENCE)


class KernelUnavailable(RuntimeError):
    """COC_ATTN_KERNEL=fused, but no fused kernel can run this call."""


@dataclass(frozen=True)
class Choice:
    """The kernel for one call shape, and why it is the reference when it is (None: fused)."""

    kernel: object
    fallback_reason: str | None = None

    @property
    def name(self) -> str:
        return self.kernel.name


def devices_here() -> list:
    """The device types of this process that have a backend: the CPU, then CUDA / Ascend when present."""
    import torch

    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else []) + (["npu"] if hasattr(torch, "npu") else [])


def fused_kernel(device_type: str, dtype, head_dim: int):
    """(the fused kernel for this device, dtype and head dim, None) or (None, why not)."""
    if device_type == "cpu":
        from coc_inject.attention_kernels import cpu

        return cpu.kernel_for(dtype, head_dim)
    if device_type == "cuda":
        from coc_inject.attention_kernels import cuda

        return cuda.kernel_for(dtype, head_dim)
    if device_type == "npu":
        from coc_inject.attention_kernels import npu

        return npu.kernel_for(dtype, head_dim)
    return None, f"no fused attention kernel for {device_type} tensors"


def choose(preference: str, device_type: str, dtype, head_dim: int) -> Choice:
    """The kernel for calls on ``device_type`` in ``dtype`` with this head dim, decided once per
    layer and call shape (never per step). ``preference``: COC_ATTN_KERNEL."""
    from coc_inject.attention_kernels import reference

    if preference == REFERENCE:
        return Choice(reference.KERNEL, "COC_ATTN_KERNEL=reference")
    kernel, why_not = fused_kernel(device_type, dtype, head_dim)
    if kernel is not None:
        return Choice(kernel)
    if preference == FUSED:
        raise KernelUnavailable(f"COC_ATTN_KERNEL=fused: no fused attention kernel can run this call ({why_not}); "
                                "expected auto (the reference kernel where no fused one runs) or reference")
    return Choice(reference.KERNEL, why_not)
