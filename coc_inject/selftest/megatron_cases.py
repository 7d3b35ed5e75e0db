"""What the multi-copy and MoE cases share: Megatron's parallel state for one wing, the collectives'
recorder, and one step run as Megatron does it and with coc-inject installed, compared."""

from __future__ import annotations

import contextlib
import hashlib

from coc_inject.selftest import common


def run_case(ctx, wing: str, case: str, backend: str, one_rank: str, check, **sizes) -> list:
    """``check(ctx, case, backend)``'s row inside :func:`megatron_state` (``sizes``), or why it cannot run:
    ``one_rank`` on a world of one, or no megatron-core."""
    ctx.progress(wing, case)
    if ctx.world < 2:
        return [common.skipped(wing, case, backend, f"world size 1: {one_rank}")]
    try:
        import megatron.core  # noqa: F401
    except ImportError as error:
        return [common.skipped(wing, case, backend, f"megatron-core is not importable ({error})",
                                missing="megatron-core")]
    with megatron_state(ctx, **sizes):
        return [check(ctx, case, backend)]


@contextlib.contextmanager
def megatron_state(ctx, **sizes):
    """Megatron's parallel state for this wing only; no installation and no state left behind."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from coc_inject import job
    from coc_inject.testbed import ranks

    if ctx.device.type == "cpu":
        ranks.point_megatron_at_cpu()  # Megatron allocates its SP buffers on the current CUDA device
    before = set(dist.distributed_c10d._world.pg_map)
    parallel_state.destroy_model_parallel()
    try:
        parallel_state.initialize_model_parallel(**sizes)
        yield
    finally:
        job.uninstall()
        parallel_state.destroy_model_parallel()
        for group in [g for g in dist.distributed_c10d._world.pg_map if g not in before]:
            dist.destroy_process_group(group)  # Megatron only forgets its groups; gloo's keep a thread each


@contextlib.contextmanager
def recorded(calls: list):
    """Every collective issued inside, in order: (name, shapes, copy). Entered before coc-inject is
    installed, it sits beneath coc-inject's wrappers and sees the order calls reach the network. It
    only observes: the copy is what the copies' run itself knows (the copy thread's in the forward,
    the running node's in the backward)."""
    from coc_inject import dist_interception
    from coc_inject.multi_copy import scheduler

    def recording(name, original):
        def record(*args, **kwargs):
            first = args[0] if args else next(iter(kwargs.values()))
            tensors = first if isinstance(first, (list, tuple)) else [first]
            calls.append((name, [tuple(t.shape) for t in tensors if hasattr(t, "shape")],
                          scheduler.current_copy()))
            return original(*args, **kwargs)

        record.__wrapped__ = original  # coc-inject finds async_op in the signature through it
        return record

    with dist_interception.replaced(recording):
        yield calls


def order_error(calls: list, ctx) -> float:
    """0.0 when every rank recorded the same sequence (a digest of it compared), else 1.0."""
    import torch
    import torch.distributed as dist

    digest = int.from_bytes(hashlib.sha256(repr(calls).encode()).digest()[:8], "little", signed=True)
    mine = torch.tensor([digest], dtype=torch.int64, device=ctx.device)
    gathered = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(gathered, mine, group=ctx.group)
    return 0.0 if all(int(other.item()) == digest for other in gathered) else 1.0


def against_megatron(ctx, step, install, last_route, truth_step=None, order=lambda calls: calls):
    """The truth: ``truth_step()`` (default ``step()``) as Megatron runs it; ``step()`` timed; then inside
    ``install()``: ``step()`` recorded (``last_route()`` right after), then timed; coc-inject uninstalled
    after each. A step returns (output, input grad, {parameter: grad}). -> (errors: output, input grad,
    param grads (a missing one counts as zeros), collective order of ``order(calls)``; [coc ms, Megatron
    ms] the MAX over ranks; the calls; the route)."""
    import torch

    from coc_inject import job

    truth = (truth_step or step)()
    if truth_step is not None:
        step()  # the warm-up of Megatron's timing
    _, reference_ms = common.timed(step, ctx.device, ctx.reps)
    calls = []
    with recorded(calls):
        try:  # coc-inject's wrappers come off before the recorder's
            install()
            got, route = step(), last_route()
        finally:
            job.uninstall()
    install()
    try:
        _, coc_ms = common.timed(step, ctx.device, ctx.reps)
    finally:
        job.uninstall()
    grads = [common.relative_error(got[2].get(name, torch.zeros_like(want)), want, ctx.group)
             for name, want in sorted(truth[2].items())]
    errors = {"output": common.relative_error(got[0], truth[0], ctx.group),
              "input grad": common.relative_error(got[1], truth[1], ctx.group), "param grads": max(grads),
              "collective order": order_error(order(calls), ctx)}
    return errors, [common.max_over_ranks(t, ctx.group, ctx.device) for t in (coc_ms, reference_ms)], calls, route


def main_grads(module) -> dict:
    """{name: gradient}, every backward's share summed in fp32 as Megatron's DDP keeps main_grad (copies
    and pieces add theirs one by one)."""
    sums = {}

    def keep(name):
        def hook(param):
            sums[name] = param.grad.float() + sums.get(name, 0)
            param.grad = None

        return hook

    for name, param in module.named_parameters():
        param.register_post_accumulate_grad_hook(keep(name))
    return sums
