"""Host time a wrapped call costs beyond Megatron's own call where its wing steps aside (issue 52's target:
<= 2 us, the median of many), one gloo rank on the CPU, forward only (no_grad), tiny shapes so that the host
is all there is: a ColumnParallelLinear and a RowParallelLinear at TP 1 (``COC_PARALLEL_NUM=auto``), a
TransformerBlock at TP 1 (``COC_MULTI_COPY=auto``), an MoE layer at EP 1 (``COC_MOE_OVERLAP=auto``), and a
DotProductAttention built with CP 1 (``COC_CP_ALGO=auto``). Each: the same module called with the wing
installed and uninstalled, alternating over ``--reps`` rounds of ``--calls`` calls each; the median of the
rounds' differences per call.

    python benchmarks/host_calls.py [--reps 41] [--calls 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's coc_inject
from coc_inject.testbed.ranks import free_port  # noqa: E402

TARGET_US = 2.0


def _per_call_us(function, calls: int) -> float:
    """This thread's CPU time per call: other processes' load on a shared machine (its waits) left out."""
    start = time.thread_time_ns()
    for _ in range(calls):
        function()
    return (time.thread_time_ns() - start) / calls / 1e3


def _python_calls(function, calls: int = 20) -> float:
    """cProfile's calls (functions and builtins) per call: deterministic where timings are not."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        function()
    profile.disable()
    return sum(row[1] for row in pstats.Stats(profile).stats.values()) / calls


def _modules():
    """{name: (call, the COC settings of its wing)} on Megatron's layers built at TP 1, CP 1, EP 1."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coc_inject.testbed.cpu import CpuLayerNorm
    from coc_inject.testbed.cpu import cpu_moe_shims

    cpu_moe_shims()
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                               hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               gradient_accumulation_fusion=False, use_cpu_initialization=True, add_bias_linear=False)
    column = ColumnParallelLinear(16, 16, config=config, init_method=torch.nn.init.zeros_, bias=False)
    row = RowParallelLinear(16, 16, config=config, init_method=torch.nn.init.zeros_, bias=False,
                            input_is_parallel=True, skip_bias_add=True)
    x = torch.zeros(4, 1, 16)
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block = TransformerBlock(config, spec)
    block.final_layernorm = CpuLayerNorm(config, 16) if block.final_layernorm is not None else None
    mask = torch.triu(torch.ones(1, 1, 4, 4, dtype=torch.bool), diagonal=1)
    attention = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                    attention_type="self")
    q = torch.zeros(4, 1, 4, 4)
    moe_config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32,
                                   num_moe_experts=2, moe_router_topk=1, moe_token_dispatcher_type="alltoall",
                                   moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
                                   gradient_accumulation_fusion=False, bias_activation_fusion=False,
                                   moe_router_pre_softmax=True)
    moe_spec = get_gpt_layer_local_spec(num_experts=2, moe_grouped_gemm=False).submodules.mlp
    moe = moe_spec(config=moe_config) if callable(moe_spec) else build_module(moe_spec, config=moe_config)
    return {
        "ColumnParallelLinear TP 1": (column, (x,), {"parallel_num": "auto"}),
        "RowParallelLinear TP 1": (row, (x,), {"parallel_num": "auto"}),
        "TransformerBlock TP 1 (1 layer)": (block, (x, mask), {"multi_copy": "auto"}),
        "MoELayer EP 1": (moe, (x,), {"moe_overlap": "auto"}),
        "DotProductAttention CP 1": (attention, (q, q, q, mask), {"cp_algo": "auto"}),
    }


def _no_op(self, *args, **kwargs):
    return None


def _wrapper_alone(module, arguments, calls: int) -> tuple:
    """The installed forward's own cost: its closure's Megatron forward (``original`` /
    ``original_forward``) swapped for a no-op for the measurement, against that no-op called alone
    (microseconds of CPU time per call, the median of 41 rounds' differences)."""
    forward = type(module).forward
    names = forward.__code__.co_freevars
    name = next(n for n in ("original", "original_forward") if n in names)
    cell = forward.__closure__[names.index(name)]
    megatron, cell.cell_contents = cell.cell_contents, _no_op
    try:
        forward(module, *arguments)  # decided (cached) with the no-op in place
        differences = []
        for _ in range(41):
            differences.append(_per_call_us(lambda: forward(module, *arguments), calls)
                               - _per_call_us(lambda: _no_op(module, *arguments), calls))
        return statistics.median(differences)
    finally:
        cell.cell_contents = megatron


def _install(settings: dict) -> None:
    from coc_inject.config import CocConfig
    from coc_inject.settings.parsers import AUTO
    from coc_inject.testbed.models import install_every_wing

    config = CocConfig(**{key: AUTO if key in ("parallel_num", "multi_copy") else value
                          for key, value in settings.items()})
    install_every_wing(config).armed_coverage()  # the calls are counted, as in a job


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=41)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    import torch
    import torch.distributed as dist

    from coc_inject import job

    torch.set_num_threads(1)
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from coc_inject.testbed.models import fresh_rng_tracker

    parallel_state.initialize_model_parallel(1, 1)
    fresh_rng_tracker()
    rows = {}
    try:
        with torch.no_grad():
            for name, (module, arguments, settings) in _modules().items():
                call = functools.partial(module, *arguments)
                on, off, counted = [], [], {}
                for rep in range(args.reps + 1):
                    for wing_on in ((True, False) if rep % 2 else (False, True)):  # alternating order
                        if wing_on:
                            _install(settings)
                        else:
                            job.uninstall()
                        call()  # the first call decides (not timed)
                        (on if wing_on else off).append(_per_call_us(call, args.calls))
                        if rep == 0:
                            counted[wing_on] = _python_calls(call)
                on, off = on[1:], off[1:]  # the first round warms up
                megatron, wrapped = statistics.median(off), statistics.median(on)
                # Each round's two figures side by side: the machine's drift between rounds cancels out.
                beyond = statistics.median(a - b for a, b in zip(on, off))
                _install(settings)
                module(*arguments)
                alone = _wrapper_alone(module, arguments, args.calls)
                job.uninstall()
                extra = counted[True] - counted[False]
                rows[name] = {"megatron_us": megatron, "wrapped_us": wrapped, "beyond_us": beyond,
                              "python_calls": counted[False], "extra_python_calls": extra, "wrapper_alone_us": alone,
                              "settings": settings}
                print(f"{name:>32}: Megatron's call {megatron:7.2f} us ({counted[False]:.0f} Python calls), wrapped "
                      f"{wrapped:7.2f} us: {beyond:+.2f} us a call (CPU time; the median of {len(on)} rounds' "
                      f"differences), {extra:+.0f} Python calls; the wrapper alone (Megatron's forward a no-op) {alone:+.2f} us "
                      f"(target <= {TARGET_US} us)", flush=True)
    finally:
        job.uninstall()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    if args.json:
        Path(args.json).write_text(json.dumps({"target_us": TARGET_US, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
