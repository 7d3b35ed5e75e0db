"""Run inside the gloo worker ranks: a bf16 Megatron linear with fused gradient accumulation and apex's kernel
(tests/fakes/fused_wgrad.py) under CoC's chunks -- the weight gradient reaches the kernel as bf16 (issue 44 item 6)."""

from __future__ import annotations

import torch

from layer_cases import _installed, build_layer, make_input, relative_error, run_layer
from tests.fakes import fused_wgrad


def bf16_main_grad(kind, *, chunks, sequence_parallel, seq=16, batch=2):
    from coc_inject.config import CocConfig
    from coc_inject.linears import install as linears

    linears.uninstall()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                        dtype="bfloat16", hidden=64, ffn=128)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=seq, batch=batch, dtype="bfloat16")
    reference, _, _ = run_layer(layer, x)  # Megatron without fusion: a bf16 weight.grad
    layer.gradient_accumulation_fusion = True  # set after init: Megatron's init demands apex
    layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    layer.weight.grad_added_to_main_grad = False
    with fused_wgrad.installed():
        _installed(CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True))
        try:
            run_layer(layer, x)
            coc_calls = linears.engine().calls
        finally:
            linears.uninstall()
        kernel_calls = list(fused_wgrad.calls)
    return {
        "coc_calls": coc_calls,
        "kernel_calls": [(name, shape, str(a), str(b)) for name, shape, a, b in kernel_calls],
        "main_grad_dtype": str(layer.weight.main_grad.dtype),
        "main_grad_error": relative_error(layer.weight.main_grad, reference["weight_grad"]),
    }
