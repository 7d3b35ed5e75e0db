"""Worker functions for the MoE pieces' memory (tests/moe/test_moe.py): the peak of CPU memory allocated
through one backward of a real megatron-core MoE layer (bf16 weights, SequentialMLP experts), on
Megatron's dispatcher and as pieces.

Measured, not computed: torch's profiler with ``profile_memory`` records every allocation and free of
torch's CPU allocator (``[memory]`` events, bytes signed) on the ranks' threads; their running sum from
the forward's start is what the step holds beyond what existed before it (input, parameters, whatever
``main_grad`` buffers), and its largest value after the backward starts is the backward's peak
(activations saved by the forward included). The same layer, input and output gradient both ways.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from tests.fakes import fused_wgrad
from tests.moe.moe_cases import build_layer, layer_input, setup


BACKWARD = "coc_inject_tests.backward"


def _backward_peak(prof) -> int:
    """The largest running sum of allocated bytes from the backward's start (the BACKWARD range's)."""
    events = prof.profiler.kineto_results.events()
    (starts,) = [e.start_ns() for e in events if e.name() == BACKWARD]
    live = peak = 0
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        if start >= starts:
            peak = max(peak, live)
    return peak


def _measured_step(layer, x: torch.Tensor, fused: bool) -> dict:
    """One forward and backward under the profiler: the backward's peak, and the gradients (``main_grad``
    with fused accumulation, ``.grad`` without) as fp32 for comparing."""
    expert_params = [p for local in layer.experts.local_experts for p in local.parameters()]
    if fused:  # what Megatron's DDP gives each parameter (in an fp32 buffer, as grad_reduce_in_fp32)
        for param in expert_params:
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
            param.grad_added_to_main_grad = False
    x = x.clone().requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, _ = layer(x)
        weights = torch.arange(out.numel(), dtype=torch.float32).reshape(out.shape).sin().to(out.dtype)
        with torch.profiler.record_function(BACKWARD):
            out.backward(weights)
    peak = _backward_peak(prof)
    grads = {name: (p.main_grad if fused and hasattr(p, "main_grad") else p.grad).float().clone()
             for name, p in layer.named_parameters() if p.grad is not None or hasattr(p, "main_grad")}
    for param in layer.parameters():
        param.grad = None
        for attribute in ("main_grad", "grad_added_to_main_grad"):
            param.__dict__.pop(attribute, None)
    return {"peak": peak, "grads": grads, "x_grad": x.grad.float()}


def backward_peak_case(fused: bool, experts: int = 8, hidden: int = 64, ffn: int = 256, tokens: int = 16,
                       chunks: int | None = None) -> dict:
    """Megatron's dispatcher, then the pieces (COC_MOE_OVERLAP=1, ``chunks`` per expert): each backward's
    peak, one local expert's parameter count, and the largest difference of the gradients."""
    with fused_wgrad.installed() if fused else contextlib.nullcontext():
        setup(2, coc=None)
        layer = build_layer(experts=experts, hidden=hidden, ep=2, ffn_hidden_size=ffn, params_dtype=torch.bfloat16,
                            bf16=True, gradient_accumulation_fusion=fused)
        x = layer_input("random", tokens, hidden).to(torch.bfloat16)
        off = _measured_step(layer, x, fused)
        setup(2, coc={"moe_overlap": "1"}, chunks=chunks)
        on = _measured_step(layer, x, fused)
        route = layer._coc_moe
    return {
        "pieces": route.pieces, "off_peak": off["peak"], "pieces_peak": on["peak"],
        "fused_calls": len(fused_wgrad.calls),
        "expert_numel": max(sum(p.numel() for p in local.parameters()) for local in layer.experts.local_experts),
        "local_experts": layer.num_local_experts,
        "grad_diff": max((on["grads"][n] - g).abs().max().item() for n, g in off["grads"].items()),
        "grad_scale": max(g.abs().max().item() for g in off["grads"].values()),
        "x_grad_diff": (on["x_grad"] - off["x_grad"]).abs().max().item(),
        "x_grad_scale": off["x_grad"].abs().max().item(),
        "same_params": sorted(on["grads"]) == sorted(off["grads"]),
    }
