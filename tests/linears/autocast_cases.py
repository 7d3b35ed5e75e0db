"""Worker functions: Megatron's linears under torch.autocast, unpatched and with coc-inject.

Megatron runs its forward inside ``torch.autocast`` when ``config.enable_autocast`` is set
(pipeline_parallel/schedules.py), and its linear Function is autocast-aware: ``custom_fwd`` /
``custom_bwd`` run the backward under the forward's autocast state (for CUDA; on the CPU test bed the
backward is called inside the same ``torch.autocast("cpu")`` to stand in for it). The matmuls then
take the autocast dtype, the collectives after them carry its bytes, the weight gradient reaches the
fp32 parameter cast back by autograd.
"""

from __future__ import annotations

import contextlib

import fused_cases
import torch

from layer_cases import build_layer, grad_for, make_input, relative_error
from tests.fakes import fused_wgrad

CARRYING = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
            "reduce_scatter_single", "_all_gather_base", "_reduce_scatter_base")


def _recording(carried: dict):
    """Bytes each collective call carries, by (collective kind, dtype): its input tensor(s)."""
    from coc_inject import dist_interception

    def record(name, function):
        def call(*args, **kwargs):
            local = args[1] if name.startswith(("all_gather", "_all_gather", "reduce_scatter", "_reduce")) else args[0]
            for tensor in local if isinstance(local, (list, tuple)) else [local]:
                kind = "all_reduce" if name == "all_reduce" else ("gather" if "gather" in name else "scatter")
                key = f"{kind} {str(tensor.dtype).replace('torch.', '')}"
                carried[key] = carried.get(key, 0) + tensor.numel() * tensor.element_size()
            return function(*args, **kwargs)

        call.__wrapped__ = function
        return call

    return dist_interception.replaced(record, CARRYING)


def _step(column, row, x, autocast_dtype):
    """Column -> gelu -> Row, forward and backward inside CPU autocast; what came out, and the bytes."""
    for layer in (column, row):
        layer.zero_grad(set_to_none=True)
        if hasattr(layer.weight, "main_grad"):
            layer.weight.main_grad.zero_()
    inp = x.detach().clone().requires_grad_(True)
    forward, backward = {}, {}
    with torch.autocast("cpu", dtype=autocast_dtype):
        with _recording(forward):
            hidden, _ = column(inp)
            output, _ = row(torch.nn.functional.gelu(hidden))
        with _recording(backward):
            output.backward(grad_for(output))
    result = {"output": output.detach(), "hidden": hidden.detach(), "input_grad": inp.grad}
    for name, layer in (("column", column), ("row", row)):
        weight = layer.weight
        result[f"{name}_wgrad"] = weight.main_grad.clone() if hasattr(weight, "main_grad") else weight.grad
        if layer.bias is not None:
            result[f"{name}_bgrad"] = layer.bias.grad
    return result, {"forward": forward, "backward": backward}


def column_row(*, chunks, sequence_parallel, input_dtype="float32", bias=False, seq=16, batch=2, hidden=32,
               ffn=64, main_grad=False, fused_kernel=False):
    """Megatron's ColumnParallelLinear -> RowParallelLinear (fp32 weights) under CPU autocast in bf16,
    unpatched then with COC_PARALLEL_NUM=chunks: dtypes, errors, and the bytes each direction carried."""
    from coc_inject.config import CocConfig
    from coc_inject.linears import install as linears

    linears.uninstall()
    column = build_layer("column", sequence_parallel=sequence_parallel, bias=bias, skip_bias_add=False,
                         dtype="float32", hidden=hidden, ffn=ffn, seed=31)
    row = build_layer("row", sequence_parallel=sequence_parallel, bias=bias, skip_bias_add=False,
                      dtype="float32", hidden=hidden, ffn=ffn, seed=32)
    if main_grad:  # gradient_accumulation_fusion into an fp32 main_grad (tests/fakes/fused_wgrad.py's kernel)
        for layer in (column, row):
            layer.gradient_accumulation_fusion = True
            layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
    x = make_input("column", column, sequence_parallel=sequence_parallel, seq=seq, batch=batch,
                   dtype=input_dtype)
    config = CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True,
                       **({"fused": True, "fused_backend": "symm_mem"} if fused_kernel else {}))
    with contextlib.ExitStack() as stack:
        if main_grad:
            stack.enter_context(fused_wgrad.installed())
        if fused_kernel:
            fused_cases.use_fakes(True, symm_mem=True)
            stack.callback(fused_cases.use_fakes, False)
        reference, reference_bytes = _step(column, row, x, torch.bfloat16)
        assert linears.install(config)
        stack.callback(linears.uninstall)
        _step(column, row, x, torch.bfloat16)  # the first CoC call agrees the settings over the group
        calls, wgrad_calls = linears.engine().calls, len(fused_wgrad.calls)
        coc, coc_bytes = _step(column, row, x, torch.bfloat16)
        calls = linears.engine().calls - calls
        kernels = [call[0] for call in fused_cases.fake_calls()["symm_mem"]] if fused_kernel else []
        wgrad_kernels = [call[2:] for call in fused_wgrad.calls[wgrad_calls:]]
    return {
        "coc_calls": calls,
        "dtypes": {name: (str(reference[name].dtype), str(coc[name].dtype)) for name in reference},
        "errors": {name: relative_error(coc[name], reference[name]) for name in reference},
        "bytes": (reference_bytes, coc_bytes),
        "fused_kernels": kernels,
        "wgrad_kernel_operands": [str(dtypes) for dtypes in wgrad_kernels],
    }
