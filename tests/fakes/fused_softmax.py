"""CPU stand-ins for Megatron's fused softmax extensions, so that ``masked_softmax_fusion`` (Megatron-LM's
default) takes its GPU path on the CPU: ``FusedScaleMaskSoftmax.is_kernel_available`` checks only the
dtype, the shapes and ``get_batch_per_block`` (no device), then imports the extensions by name inside
``ScaledUpperTriangMaskedSoftmax`` / ``ScaledMaskedSoftmax`` / ``ScaledSoftmax``.

The contracts of the CUDA kernels (megatron/fused_kernels, apex's csrc/megatron), checked here:

* ``scaled_upper_triang_masked_softmax_cuda``: 3-D fp16/bf16 ``[attn_batches, sq, sk]``, causal, **no
  mask argument** (a layer of mask type causal ignores the mask tensor on this path), the kernel
  treats the rows as a square ``sq x sq`` matrix: ``sq == sk`` asserted, ``sq <= 16384``.
* ``scaled_masked_softmax_cuda``: 4-D fp16/bf16 ``[b, np, sq, sk]``, a ``[b|1, 1, sq, sk]`` mask (True /
  1 = masked), ``sk <= 4096``, ``sq > 1``.
* ``scaled_softmax_cuda``: 4-D fp16/bf16, no mask, ``sk <= 16384``.

Masked positions take -10000 (not -inf: a fully masked row averages every key, as Megatron's torch
path does), the math runs in fp32 and the result comes back in the input dtype; each backward is
``scale * y * (dy - sum(dy * y))`` in fp32. ``get_batch_per_block`` is the CUDA code's
(``scaled_masked_softmax.h``, warp size 32). Verified against these contracts only, never on a GPU.
"""

from __future__ import annotations

import contextlib
import sys
import types

import torch

NAMES = ("scaled_upper_triang_masked_softmax_cuda", "scaled_masked_softmax_cuda", "scaled_softmax_cuda")
MASKED = -10000.0
WARP_SIZE = 32
calls: list = []  # (extension, input shape) of every forward since install()


def _check(name: str, inputs: torch.Tensor, dim: int) -> None:
    if inputs.dim() != dim:
        raise RuntimeError(f"{name}: expected {dim}D tensor, got {tuple(inputs.shape)}")
    if inputs.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"{name}: Only fp16 and bf16 are supported, got {inputs.dtype}")
    calls.append((name, tuple(inputs.shape)))


def _softmax(scores: torch.Tensor, hidden, scale, dtype) -> torch.Tensor:
    scores = scores.float() * float(scale)
    if hidden is not None:
        scores = scores.masked_fill(hidden, MASKED)
    return torch.softmax(scores, dim=-1).to(dtype)


def _backward(output_grads, softmax_results, scale) -> torch.Tensor:
    y, dy = softmax_results.float(), output_grads.float()
    return (float(scale) * y * (dy - (dy * y).sum(dim=-1, keepdim=True))).to(output_grads.dtype)


def upper_triang_forward(inputs, scale):
    name = NAMES[0]
    _check(name, inputs, 3)
    batches, sq, sk = inputs.shape
    assert sq == sk, f"{name}: the causal kernel takes a square score matrix (sq == sk), got {sq} x {sk}"
    assert sq <= 16384, f"{name}: sequence length {sq} > 16384"
    causal = torch.ones(sq, sk, dtype=torch.bool, device=inputs.device).triu(1)
    return _softmax(inputs, causal, scale, inputs.dtype)


def masked_forward(inputs, mask, scale):
    name = NAMES[1]
    _check(name, inputs, 4)
    b, heads, sq, sk = inputs.shape
    assert sk <= 4096 and sq > 1, f"{name}: {sq} queries x {sk} keys out of the kernel's range"
    assert mask.dim() == 4 and mask.shape[1] == 1 and tuple(mask.shape[2:]) == (sq, sk) \
        and mask.shape[0] in (1, b), f"{name}: mask {tuple(mask.shape)} for scores {tuple(inputs.shape)}"
    return _softmax(inputs, mask.bool(), scale, inputs.dtype)


def softmax_forward(inputs, scale):
    name = NAMES[2]
    _check(name, inputs, 4)
    assert inputs.shape[-1] <= 16384, f"{name}: {inputs.shape[-1]} keys > 16384"
    return _softmax(inputs, None, scale, inputs.dtype)


def get_batch_per_block(query_seq_len: int, key_seq_len: int, batches: int, attn_heads: int) -> int:
    """scaled_masked_softmax.h: rows of the scores one CUDA block of 128 threads handles."""
    log2_elements = (key_seq_len - 1).bit_length() if key_seq_len > 1 else 0
    next_power_of_two = 1 << log2_elements
    warp_size = min(next_power_of_two, WARP_SIZE)
    batches_per_warp = 2 if next_power_of_two <= 128 else 1
    warps_per_block = 128 // warp_size
    return warps_per_block * batches_per_warp


def modules() -> dict:
    upper = types.ModuleType(NAMES[0])
    upper.forward, upper.backward = upper_triang_forward, _backward
    masked = types.ModuleType(NAMES[1])
    masked.forward, masked.backward, masked.get_batch_per_block = masked_forward, _backward, get_batch_per_block
    plain = types.ModuleType(NAMES[2])
    plain.forward, plain.backward = softmax_forward, _backward
    return {NAMES[0]: upper, NAMES[1]: masked, NAMES[2]: plain}


@contextlib.contextmanager
def installed():
    """Inside, Megatron's fused softmax finds the stand-ins as its CUDA extensions."""
    saved = {name: sys.modules.get(name) for name in NAMES}
    sys.modules.update(modules())
    calls.clear()
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
