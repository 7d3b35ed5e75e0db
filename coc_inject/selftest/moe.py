"""MoE: one real megatron-core MoE layer (alltoall dispatcher, SequentialMLP experts, EP = the world,
2 local experts a rank, top-2) forward + backward with the dispatcher's all-to-alls in pieces (a fixed
2 chunks a local expert) against Megatron's layer as it is: the output's, the input gradient's and the
parameter gradients' errors (fixed output gradient), that the layer ran as pieces (its route, every
rank), that every rank issued the same collectives in the same order (by name: the all-to-alls' row
counts differ between ranks by design), the time of both."""

from __future__ import annotations

from coc_inject.selftest import common

WING = "moe"
LOCAL_EXPERTS, CHUNKS, TOPK, TOKENS, HIDDEN, FFN = 2, 2, 2, 64, 32, 64


def run(ctx) -> list[dict]:
    from coc_inject.selftest.megatron_cases import run_case

    return run_case(ctx, WING, f"MoE layer EP={ctx.world} {LOCAL_EXPERTS} local top-{TOPK}", f"pieces c={CHUNKS}",
                    "expert parallelism 1 has no all-to-all", _case, expert_model_parallel_size=ctx.world)


def _case(ctx, case, backend) -> dict:
    import torch
    from megatron.core.transformer.moe import moe_layer, moe_utils

    from coc_inject.testbed.cpu import cpu_moe_shims
    from coc_inject.testbed.models import build_moe_layer, fresh_rng_tracker
    from coc_inject.config import CocConfig
    from coc_inject.moe import install
    from coc_inject.selftest.megatron_cases import against_megatron, main_grads

    if ctx.device.type == "cpu":
        cpu_moe_shims()  # the dispatcher's side stream and gloo's list-only split sizes
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.13-0.16's router reads it, defined only when TE imports
        moe_utils.te_general_gemm = None
    dtype = ctx.torch_dtype()
    torch.manual_seed(1234 + ctx.rank)  # every rank's experts differ: a token sent to a wrong one shows
    fresh_rng_tracker()
    layer = build_moe_layer(HIDDEN, FFN, LOCAL_EXPERTS * ctx.world, TOPK, ctx.world, dtype).to(ctx.device)
    x_in = torch.randn(TOKENS, 1, HIDDEN).to(ctx.device, dtype)
    grad = torch.randn(x_in.shape, generator=torch.Generator().manual_seed(7 + ctx.rank)).to(ctx.device, dtype)

    grads = main_grads(layer)

    def step():
        grads.clear()
        x = x_in.clone().requires_grad_(True)
        out, _ = layer(x)
        out.backward(grad)
        return out.detach(), x.grad, dict(grads)

    config = CocConfig(moe_overlap="1")
    errors, times, calls, route = against_megatron(ctx, step, lambda: install.install(config, moe_layer, CHUNKS),
                                                   lambda: getattr(layer, "_coc_moe", None),
                                                   order=lambda calls: [name for name, _, _ in calls])
    ran = route is not None and route.pieces == LOCAL_EXPERTS * CHUNKS
    errors["pieces ran"] = common.max_over_ranks(float(not ran), ctx.group, ctx.device)
    return common.row(WING, case, backend, errors, ctx.dtype, *times, collectives=len(calls),
                      **({} if ran else {"why_not_pieces": getattr(route, "reason", "no MoE layer call counted")}))
