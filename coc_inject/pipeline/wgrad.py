"""The weight gradient written into Megatron's ``main_grad`` (``gradient_accumulation_fusion``).

``main_grad += grad_outputᵀ @ input`` (or ``=`` for a Megatron-FSDP buffer), with the GEMM's
operands in their own dtype: a bf16 job must not copy its activation to fp32 for every linear.
The way is chosen once per (device type, operand dtypes, ``main_grad`` dtype, kernel module), in
this order:

1. **same dtype** (fp32 operands into an fp32 ``main_grad``, bf16 into bf16): a plain in-place
   ``addmm_`` -- exactly what ran before the choice existed.
2. **Megatron's kernel**: fp16/bf16 operands into an fp32 ``main_grad`` where Megatron's linears
   module holds ``fused_weight_gradient_mlp_cuda`` (apex's on a GPU; MindSpeed patches its own in
   on an NPU; tests/fakes/fused_wgrad.py on the CPU test bed): ``wgrad_gemm_accum_fp32(total_input,
   grad_output, main_grad)`` with contiguous 2-D operands, as Megatron 0.12 ... 0.19 call it.
3. **torch's mixed-dtype GEMM**: ``addmm(..., out_dtype=float32, out=main_grad)`` where the running
   torch has a kernel for ``aten::addmm.dtype_out`` on the device (recent torch on CUDA; not on CPU),
   checked once by a 1x1 call (the dtype rules changed between releases: 2.8 wanted ``self`` in the
   operands' dtype).
4. **upcast** (CPU without the kernel, an old torch, mixed operand dtypes): the operands copied
   to ``main_grad``'s dtype, then one GEMM -- said once in the log when it first runs with operands
   of another dtype.

The choice reads no device value (no host sync) and raises nothing per call.
"""

from __future__ import annotations

import functools
import logging
import sys

import torch

SAME, KERNEL = "same dtype", "Megatron's fused_weight_gradient_mlp_cuda"
MIXED, UPCAST = "torch mixed-dtype addmm", "upcast"
HALF = (torch.float16, torch.bfloat16)
_LINEARS = "megatron.core.tensor_parallel.layers"
_logger = logging.getLogger("coc_inject")  # coc_inject.log's logger (a floor above: reached by name)


def megatron_kernel():
    """The wgrad kernel module Megatron's linears would call now, or None (no apex, no patch)."""
    layers = sys.modules.get(_LINEARS)
    if layers is None or not getattr(layers, "_grad_accum_fusion_available", False):
        return None
    return getattr(layers, "fused_weight_gradient_mlp_cuda", None)


def _dispatch_key(device_type: str) -> str:
    """The dispatcher's backend key for a device type (an NPU's torch_npu registers as PrivateUse1)."""
    return {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "meta": "Meta"}.get(device_type, "PrivateUse1")


@functools.cache
def torch_mixed_addmm(device_type: str, operand_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether this torch runs ``addmm(fp32 out, half, half, out_dtype=fp32, out=)`` on the device:
    a kernel registered for ``aten::addmm.dtype_out``, then one 1x1 call (its dtype checks)."""
    if out_dtype != torch.float32 or operand_dtype not in HALF:
        return False
    has_kernel = getattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", None)
    try:
        if has_kernel is None or not has_kernel("aten::addmm.dtype_out", _dispatch_key(device_type)):
            return False
        accum = torch.zeros(1, 1, dtype=out_dtype, device=device_type)
        operand = torch.ones(1, 1, dtype=operand_dtype, device=device_type)
        torch.addmm(accum, operand, operand, out_dtype=out_dtype, out=accum)
        return True
    except (RuntimeError, TypeError, NotImplementedError) as error:
        _logger.debug("torch's mixed-dtype addmm unusable on %s (%s): %s", device_type, operand_dtype, error)
        return False


@functools.lru_cache(maxsize=None)
def choose(device_type: str, input_dtype: torch.dtype, grad_dtype: torch.dtype, accum_dtype: torch.dtype,
           kernel, overwrite: bool) -> str:
    """How the weight gradient reaches ``main_grad`` for these dtypes (once per key)."""
    if input_dtype == grad_dtype == accum_dtype:
        return SAME
    mixed = input_dtype == grad_dtype and input_dtype in HALF and accum_dtype == torch.float32
    if mixed and kernel is not None and not overwrite:
        way = KERNEL
    elif mixed and torch_mixed_addmm(device_type, input_dtype, accum_dtype):
        way = MIXED
    else:
        way = UPCAST
        why = ("neither Megatron's wgrad kernel nor torch's mixed-dtype addmm is there" if mixed
               else "no GEMM takes these operand dtypes together")
        _logger.info("weight gradient on %s: %s x %s operands copied to %s before the GEMM into %s (%s)",
                     device_type, grad_dtype, input_dtype, accum_dtype,
                     "Megatron-FSDP's main grad buffer" if overwrite else "main_grad", why)
    if way != UPCAST:
        _logger.debug("weight gradient on %s, %s operands into %s main_grad: %s", device_type, input_dtype,
                      accum_dtype, way)
    return way


def into_main_grad(accum: torch.Tensor, grad2d: torch.Tensor, input2d: torch.Tensor, overwrite: bool = False):
    """``accum += grad2dᵀ @ input2d`` (``=`` when ``overwrite``): ``grad2d`` ``[m, n]``, ``input2d``
    ``[m, k]``, ``accum`` ``[n, k]``."""
    kernel = None if overwrite else megatron_kernel()
    way = choose(accum.device.type, input2d.dtype, grad2d.dtype, accum.dtype, kernel, overwrite)
    if way == KERNEL and accum.is_contiguous():  # Megatron's main_grad is (a view into its contiguous buffer)
        kernel.wgrad_gemm_accum_fp32(input2d.contiguous(), grad2d.contiguous(), accum)
    elif way == MIXED:
        torch.addmm(accum, grad2d.t(), input2d, out_dtype=accum.dtype, beta=0 if overwrite else 1, out=accum)
    elif way == SAME and not overwrite:
        accum.addmm_(grad2d.t(), input2d)
    elif way == SAME:
        torch.matmul(grad2d.t(), input2d, out=accum)
    elif overwrite:
        torch.matmul(grad2d.t().to(accum.dtype), input2d.to(accum.dtype), out=accum)
    else:
        accum.addmm_(grad2d.t().to(accum.dtype), input2d.to(accum.dtype))
    return accum
