"""A CPU stand-in for apex's ``fused_weight_gradient_mlp_cuda``: Megatron's linears take their fused
gradient-accumulation path on the CPU.

With ``gradient_accumulation_fusion`` on (Megatron's default wherever apex or Transformer Engine is
installed: every GPU job), Megatron's linear backward does not return the weight gradient: it calls
``wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)`` (``..._fp16`` for a half or
bf16 ``main_grad``), which adds ``grad_output^T @ total_input`` into ``main_grad`` in place, and hands
autograd a dummy. apex cannot be built here (CUDA), so this module stands in: it checks the call
contract apex's kernel has (contiguous 2-D operands of one dtype with matching rows -- it reads their
raw pointers as the input's type --, a contiguous ``main_grad`` of the weight's shape and the kernel's
dtype, the fp16 kernel's in the operands' own) and computes the true result, accumulated in fp32 as the
kernel does.
Verified against this stand-in only, never against apex on a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

NAME = "fused_weight_gradient_mlp_cuda"
calls: list = []  # (kernel name, main_grad shape, input dtype, grad_output dtype) of every call since install()


def _accumulate(kernel: str, total_input, grad_output, main_grad, dtypes) -> None:
    if total_input.dim() != 2 or grad_output.dim() != 2:
        raise RuntimeError(f"{kernel}: expects 2-D input and grad_output, got {tuple(total_input.shape)} and "
                           f"{tuple(grad_output.shape)} (Megatron flattens them before the call)")
    if total_input.shape[0] != grad_output.shape[0]:
        raise RuntimeError(f"{kernel}: input has {total_input.shape[0]} rows, grad_output {grad_output.shape[0]}")
    if tuple(main_grad.shape) != (grad_output.shape[1], total_input.shape[1]):
        raise RuntimeError(f"{kernel}: main_grad {tuple(main_grad.shape)} is not "
                           f"[{grad_output.shape[1]}, {total_input.shape[1]}]")
    if total_input.dtype != grad_output.dtype or not (total_input.is_contiguous() and grad_output.is_contiguous()):
        raise RuntimeError(f"{kernel}: expects contiguous operands of one dtype, got {total_input.dtype} and "
                           f"{grad_output.dtype} (Megatron makes them contiguous before the call)")
    if main_grad.dtype not in dtypes or not main_grad.is_contiguous():
        raise RuntimeError(f"{kernel}: main_grad must be a contiguous {dtypes} tensor, got {main_grad.dtype}")
    if main_grad.dtype != torch.float32 and main_grad.dtype != total_input.dtype:
        raise RuntimeError(f"{kernel}: a {main_grad.dtype} main_grad takes operands of its dtype, "
                           f"got {total_input.dtype}")
    calls.append((kernel, tuple(main_grad.shape), total_input.dtype, grad_output.dtype))
    product = grad_output.float().t() @ total_input.float()
    main_grad.copy_((main_grad.float() + product).to(main_grad.dtype))


def wgrad_gemm_accum_fp32(total_input, grad_output, main_grad) -> None:
    _accumulate("wgrad_gemm_accum_fp32", total_input, grad_output, main_grad, (torch.float32,))


def wgrad_gemm_accum_fp16(total_input, grad_output, main_grad) -> None:
    _accumulate("wgrad_gemm_accum_fp16", total_input, grad_output, main_grad, (torch.float16, torch.bfloat16))


def module() -> types.ModuleType:
    fake = types.ModuleType(NAME)
    fake.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    fake.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    fake.__doc__ = __doc__
    return fake


@contextlib.contextmanager
def installed():
    """Inside, Megatron's linears (already imported or not) find the stand-in as apex's kernel."""
    from megatron.core.tensor_parallel import layers

    saved_module = sys.modules.get(NAME)
    saved = {name: getattr(layers, name, None) for name in (NAME, "_grad_accum_fusion_available")}
    fake = sys.modules[NAME] = module()
    layers.fused_weight_gradient_mlp_cuda = fake
    layers._grad_accum_fusion_available = True
    calls.clear()
    try:
        yield fake
    finally:
        if saved_module is None:
            sys.modules.pop(NAME, None)
        else:
            sys.modules[NAME] = saved_module
        for name, value in saved.items():
            if value is None:
                layers.__dict__.pop(name, None)
            else:
                setattr(layers, name, value)
