"""Functions run inside the gloo worker ranks (see dist_harness.py).

They build real megatron-core layers, run them unpatched and with coc-inject installed on
the same weights and inputs, and return plain numbers (errors, collective counts) to the
test process, where the assertions are.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from coc_inject.linears.guards import tp_group

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter_tensor", "reduce_scatter_single", "_all_gather_base", "_reduce_scatter_base",
)


def count_collectives(counts: dict):
    """Count collective calls, also through aliases Megatron bound at import time."""
    from coc_inject import dist_interception

    def counting(name, function):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return function(*args, **kwargs)

        call.__wrapped__ = function
        return call

    return dist_interception.replaced(counting, COLLECTIVES)


def tp_rank_size():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def takes_tp_group() -> bool:
    """Whether Megatron's linear layers take a tp_group (megatron-core >= 0.13)."""
    import inspect

    from megatron.core.tensor_parallel.layers import RowParallelLinear

    return "tp_group" in inspect.signature(RowParallelLinear.__init__).parameters


def build_layer(kind, *, sequence_parallel, bias, skip_bias_add, dtype, hidden, ffn, seed=1234,
                gather_output=False, tp_group=None, is_expert=False, frozen=False, input_is_parallel=True,
                transformer_impl=None):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    tp = tp_group.size() if tp_group is not None else tp_rank_size()[1]
    config = ModelParallelConfig(
        tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel,
        use_cpu_initialization=True, params_dtype=DTYPES[dtype], gradient_accumulation_fusion=False,
    )
    if transformer_impl is not None:  # a TransformerConfig field, read by the layers with getattr
        config.transformer_impl = transformer_impl
    torch.manual_seed(seed)  # the master weight is generated identically on every rank
    init = torch.nn.init.xavier_normal_
    # megatron-core 0.12's layers take no tp_group (they use parallel_state's TP group)
    group = {"tp_group": tp_group} if tp_group is not None or takes_tp_group() else {}
    if kind == "row":
        layer = RowParallelLinear(ffn, hidden, config=config, init_method=init, bias=bias,
                                  input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add,
                                  is_expert=is_expert, **group)
    else:
        layer = ColumnParallelLinear(hidden, ffn, config=config, init_method=init, bias=bias,
                                     gather_output=gather_output, skip_bias_add=skip_bias_add,
                                     is_expert=is_expert, **group)
    layer.weight.requires_grad_(not frozen)
    if layer.bias is not None:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(layer.bias.shape, generator=torch.Generator().manual_seed(seed + 7)))
    return layer


def make_input(kind, layer, *, sequence_parallel, seq, batch, dtype, seed=99):
    rank, tp = tp_group(layer).rank(), tp_group(layer).size()
    if kind == "row" and not layer.input_is_parallel:  # full activations, replicated
        rows, width, same_on_all_ranks = seq, layer.input_size, True
    elif kind == "row":
        rows, width, same_on_all_ranks = seq, layer.input_size_per_partition, False
    else:
        width = layer.input_size
        rows = seq // tp if sequence_parallel else seq
        same_on_all_ranks = not sequence_parallel  # column without SP: replicated activations
    generator = torch.Generator().manual_seed(seed + (0 if same_on_all_ranks else 1000 * (rank + 1)))
    return torch.randn(rows, batch, width, generator=generator).to(DTYPES[dtype])


def grad_for(output, seed=5):
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(seed + 31 * rank)
    return torch.randn(output.shape, generator=generator).to(output.dtype)


def run_layer(layer, x, forward_kwargs=None):
    """One forward + backward; returns tensors and the collectives each direction issued."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    forward_counts, backward_counts = {}, {}
    with count_collectives(forward_counts):
        output, output_bias = layer(x, **(forward_kwargs or {}))
    total = output if output_bias is None else output + output_bias
    with count_collectives(backward_counts):
        total.backward(grad_for(total))
    result = {"output": output.detach().clone(), "input_grad": x.grad.clone()}
    if layer.weight.requires_grad:
        result["weight_grad"] = layer.weight.grad.clone()
    if layer.bias is not None and layer.bias.grad is not None:
        bias_grad = layer.bias.grad.clone()
        if getattr(layer.bias, "sequence_parallel", False):
            # Megatron all-reduces SP-replicated bias grads at gradient finalisation.
            dist.all_reduce(bias_grad, group=tp_group(layer))
        result["bias_grad"] = bias_grad
    return result, forward_counts, backward_counts


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().item() or 1.0
    return (actual - expected).abs().max().item() / scale


def compare(kind, *, chunks, sequence_parallel=False, bias=True, skip_bias_add=False, dtype="float32",
            seq=16, batch=2, hidden=32, ffn=64, recompute_all_gather=True,
            enable_coc_in_column_backward=False, forward_kwargs=None, layer_options=None,
            config_options=None):
    """Unpatched vs coc-inject on the same layer and input: relative errors and collective counts,
    and what coc-inject logged during the CoC runs."""
    import io
    import logging

    from coc_inject import log
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    linears.uninstall()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=bias,
                        skip_bias_add=skip_bias_add, dtype=dtype, hidden=hidden, ffn=ffn,
                        **(layer_options or {}))
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=seq, batch=batch, dtype=dtype)
    reference, ref_fwd, ref_bwd = run_layer(layer, x, forward_kwargs)
    config = CocConfig(**{"parallel_num": chunks, "recompute_all_gather": recompute_all_gather,
                          "enable_coc_in_column_backward": enable_coc_in_column_backward, **(config_options or {})})
    assert linears.install(config)
    said = io.StringIO()
    handler = logging.StreamHandler(said)
    log.logger.addHandler(handler)
    level = log.logger.level
    log.logger.setLevel(logging.DEBUG)
    try:
        # The first CoC call also runs the once-per-group config agreement (through the store);
        # count the second call, and check the two are bitwise identical (determinism).
        first, _, _ = run_layer(layer, x, forward_kwargs)
        calls_before = linears.engine().calls
        coc, coc_fwd, coc_bwd = run_layer(layer, x, forward_kwargs)
        coc_calls = linears.engine().calls - calls_before
        bitwise_repeat = all(torch.equal(first[name], coc[name]) for name in coc)
    finally:
        log.logger.removeHandler(handler)
        log.logger.setLevel(level)
        linears.uninstall()
    return {
        "log": said.getvalue(),
        "errors": {name: relative_error(coc[name], reference[name]) for name in reference},
        "keys": sorted(coc),
        "coc_calls": coc_calls,
        "reference_counts": (ref_fwd, ref_bwd),
        "coc_counts": (coc_fwd, coc_bwd),
        "bitwise_repeat": bitwise_repeat,
        "shapes_equal": all(coc[name].shape == reference[name].shape for name in reference),
    }


def _installed(config):
    from coc_inject.linears import install as linears

    assert linears.install(config)
    return linears


def unpatched_then_coc(run, chunks):
    """``run()`` with Megatron's own forwards, then with CoC: (reference, coc, CoC calls made)."""
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    linears.uninstall()
    reference = run()
    _installed(CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True))
    try:
        coc = run()
        return reference, coc, linears.engine().calls
    finally:
        linears.uninstall()


def compare_main_grad(kind, *, chunks, sequence_parallel, zero_out_wgrad=False, seq=16, batch=2):
    """gradient_accumulation_fusion: wgrad lands in weight.main_grad (plain torch ops, no apex)."""
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    linears.uninstall()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=seq, batch=batch, dtype="float32")
    reference, _, _ = run_layer(layer, x)  # Megatron without fusion: plain weight.grad
    initial = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(3))
    layer.gradient_accumulation_fusion = True  # set after init: Megatron's init demands apex
    layer.weight.main_grad = initial.clone()
    layer.weight.grad_added_to_main_grad = False
    layer.weight.zero_out_wgrad = zero_out_wgrad
    _installed(CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True))
    try:
        coc, _, _ = run_layer(layer, x)
    finally:
        linears.uninstall()
    return {
        "main_grad_error": relative_error(layer.weight.main_grad, initial + reference["weight_grad"]),
        "grad_added_to_main_grad": layer.weight.grad_added_to_main_grad,
        "dummy_grad_shape_ok": tuple(coc["weight_grad"].shape) == tuple(layer.weight.shape),
        "dummy_grad_is_zero": bool((coc["weight_grad"] == 0).all()),
        "input_grad_error": relative_error(coc["input_grad"], reference["input_grad"]),
    }


def compare_explicit_weight(*, chunks, sequence_parallel, seq=16, batch=2):
    """ColumnParallelLinear.forward(input, weight=W): W is used and receives the gradient."""
    from coc_inject.linears import install as linears

    linears.uninstall()
    layer = build_layer("column", sequence_parallel=sequence_parallel, bias=False, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    x = make_input("column", layer, sequence_parallel=sequence_parallel, seq=seq, batch=batch, dtype="float32")
    external = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(11))

    def run():
        weight = external.clone().requires_grad_(True)
        inp = x.clone().requires_grad_(True)
        output, _ = layer(inp, weight=weight)
        output.backward(grad_for(output))
        return output.detach(), inp.grad, weight.grad

    reference, coc, calls = unpatched_then_coc(run, chunks)
    return {"coc_calls": calls,
            "errors": [relative_error(a, b) for a, b in zip(coc, reference)],
            "layer_weight_untouched": layer.weight.grad is None}


def compare_in_subgroups(kind, *, chunks, sequence_parallel, subgroup_size=2, seq=16, batch=2):
    """Layers built with their own tp_group (not Megatron's global TP group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + subgroup_size)))
              for start in range(0, world, subgroup_size)]
    mine = groups[rank // subgroup_size]
    try:
        result = compare(kind, chunks=chunks, sequence_parallel=sequence_parallel, seq=seq, batch=batch,
                         enable_coc_in_column_backward=True, layer_options={"tp_group": mine})
        result["group_size"] = mine.size()
    finally:
        for group in groups:  # a live gloo group keeps a busy event-loop thread (see dist_harness)
            dist.destroy_process_group(group)
    return result


def mismatched_config(chunks_by_rank):
    """Each rank installs a different chunk count: every rank must raise, none may hang."""
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig
    from coc_inject.pipeline.agreement import ConfigMismatchError

    linears.uninstall()
    layer = build_layer("row", sequence_parallel=False, bias=False, skip_bias_add=False,
                        dtype="float32", hidden=16, ffn=32)
    x = make_input("row", layer, sequence_parallel=False, seq=8, batch=1, dtype="float32")
    _installed(CocConfig(parallel_num=chunks_by_rank[dist.get_rank()]))
    try:
        layer(x)
    except ConfigMismatchError as error:
        return str(error)
    finally:
        linears.uninstall()
    return None


def fallback_is_megatron(kind, *, chunks, reason_fragment, layer_options, sequence_parallel=False, seq=16):
    """A call the engine declines runs Megatron's forward (identical numbers) and says why once."""
    import io
    import logging

    from coc_inject import log
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    linears.uninstall()
    options = {"bias": True, "skip_bias_add": False, **layer_options}
    layer = build_layer(kind, sequence_parallel=sequence_parallel, dtype="float32", hidden=32, ffn=64,
                        **options)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=seq, batch=2, dtype="float32")
    reference, _, _ = run_layer(layer, x)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log.configure("debug")
    log.logger.addHandler(handler)
    _installed(CocConfig(parallel_num=chunks))
    try:
        coc, _, _ = run_layer(layer, x)
        run_layer(layer, x)
        calls = linears.engine().calls
    finally:
        linears.uninstall()
        log.logger.removeHandler(handler)
        log.configure("info")
    said = stream.getvalue()
    return {"calls": calls, "said_times": said.count(reason_fragment),
            "bitwise_equal": all(torch.equal(coc[name], reference[name]) for name in reference)}


def train_mlp(*, chunks, sequence_parallel, steps=5, seq=16, batch=2, hidden=32, ffn=64):
    """Column -> gelu -> Row trained with Adam; the loss sequence unpatched and with CoC."""

    def losses():
        column = build_layer("column", sequence_parallel=sequence_parallel, bias=True,
                             skip_bias_add=False, dtype="float32", hidden=hidden, ffn=ffn, seed=21)
        row = build_layer("row", sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                          dtype="float32", hidden=hidden, ffn=ffn, seed=22)
        params = list(column.parameters()) + list(row.parameters())
        optimizer = torch.optim.Adam(params, lr=1e-2)
        x = make_input("column", column, sequence_parallel=sequence_parallel, seq=seq, batch=batch,
                       dtype="float32")
        target = torch.randn(x.shape, generator=torch.Generator().manual_seed(dist.get_rank()))
        history = []
        for _ in range(steps):
            optimizer.zero_grad()
            hidden_states, _ = column(x)
            output, _ = row(torch.nn.functional.gelu(hidden_states))
            loss = (output - target).pow(2).mean()
            loss.backward()
            for param in params:  # what Megatron's finalize_model_grads does for SP params
                if getattr(param, "sequence_parallel", False) and param.grad is not None:
                    dist.all_reduce(param.grad, group=tp_group(row))
            optimizer.step()
            history.append(loss.item())
        return history

    reference, coc, calls = unpatched_then_coc(losses, chunks)
    return {"reference": reference, "coc": coc, "calls": calls}


def compiled_call(kind, *, chunks, sequence_parallel, backend="eager"):
    """torch.compile of a patched layer still runs the CoC forward (and equals unpatched)."""
    from coc_inject.linears import install as linears
    from coc_inject.config import CocConfig

    linears.uninstall()
    torch._dynamo.reset()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=True, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="float32")
    reference, _, _ = run_layer(layer, x)
    _installed(CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True))
    try:
        compiled = torch.compile(layer, backend=backend)
        coc, _, _ = run_layer(compiled, x)  # also runs the one-time config agreement
        calls = linears.engine().calls
        coc, forward_counts, backward_counts = run_layer(compiled, x)
        calls = linears.engine().calls - calls
    finally:
        linears.uninstall()
        torch._dynamo.reset()
    return {"calls": calls, "forward_counts": forward_counts, "backward_counts": backward_counts,
            "errors": {name: relative_error(coc[name], reference[name]) for name in reference}}


def output_modified_in_place(kind, *, chunks, sequence_parallel):
    """Megatron code edits layer outputs in place (vocab-parallel cross-entropy subtracts the
    max from the logits): a CoC output must allow that, as Megatron's own output does."""
    from coc_inject.linears import install as linears

    linears.uninstall()
    layer = build_layer(kind, sequence_parallel=sequence_parallel, bias=False, skip_bias_add=False,
                        dtype="float32", hidden=32, ffn=64)
    x = make_input(kind, layer, sequence_parallel=sequence_parallel, seq=16, batch=2, dtype="float32")

    def run():
        inp = x.clone().requires_grad_(True)
        output, _ = layer(inp)
        output -= output.detach().max()  # in place, like cross_entropy.py
        output.backward(grad_for(output))
        return output.detach(), inp.grad

    reference, coc, calls = unpatched_then_coc(run, chunks)
    return {"calls": calls, "errors": [relative_error(a, b) for a, b in zip(coc, reference)]}
