"""``coc-inject bench --cases attention``: the context-parallel core attention, every algorithm.

ContextParallelAttention (make_schedule; causal, Megatron's 2*CP chunk layout, --dtype, the --kernel
block kernel) forward and backward on local CPU ranks (gloo): CP=2 (and CP=4 on loopback), over plain
loopback or the emulated link. The variants, interleaved by the bench engine:

* the algorithms the shape allows: ring, ulysses, allgather; at CP=4 also Double-Ring (ring, window 2)
  and hybrid (Ulysses degree 2 inside, ring across); ``auto``, as the engine's tuner chose;
* ``sdpa``: the yardstick -- torch's ``scaled_dot_product_attention`` on the whole sequence in one
  process (rank 0, the other ranks wait), what a user runs without context parallelism;
* ``ring:C``: the ring with its transfers replaced by a local copy of the same tensors (the compute-only
  twin); ``ring:M``: the ring with the block kernel skipped -- its transfers alone, in its order;
* with ``--kernel both``, every algorithm again on the reference kernel (``name [reference]``).

ring.py is instrumented from outside, by swapping its ``blocks`` and ``exchange`` names (nothing
changes in the library, nothing costs when the bench is not running): each kernel step and transfer is
timestamped -- the per-step C and M of the step-wise pipelining ideal (attention_figures), and the
timeline of one ring call.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from coc_inject import meter
from coc_inject.bench import engine, report
from coc_inject.bench.cases import attention_figures as figures
from coc_inject.testbed import attention as inputs_of, ranks
from coc_inject.testbed.attention import Variant, variants_for
from coc_inject.testbed.memory import SavedBytes
from coc_inject.timer import Timer
from coc_inject.config import CocConfig
from coc_inject.context_parallel import blocks, comm, ring
from coc_inject.context_parallel.auto import BASELINE, AttentionKey
from coc_inject.context_parallel.function import ContextParallelAttention
from coc_inject.tuning.online import Tuner

COMPUTE_ONLY, COMM_ONLY, SDPA, AUTO = "C", "M", "sdpa", "auto"
TAG = "coc-inject bench attention"


class _StepBlocks:
    """Stands in for ring.py's ``blocks`` module: times each kernel step, or skips it (M)."""

    def __init__(self, trace: meter.Recorder, run: bool):
        self._trace, self._run = trace, run

    def _step(self, fn, *args):
        with self._trace.span("compute"):  # (pass, t0, t1) per blocks.forward / blocks.backward call
            if self._run:
                fn(*args)

    def forward(self, *args):
        self._step(blocks.forward, *args)

    def backward(self, *args):
        self._step(blocks.backward, *args)


class _TracedPending:
    def __init__(self, trace: meter.Recorder, pending, started: float):
        self._trace, self._pending, self._started = trace, pending, started

    def wait(self) -> None:
        with self._trace.span("transfer", self._started):  # (pass, started, wait began, done)
            if self._pending is not None:
                self._pending.wait()


def _exchange(trace: meter.Recorder, transfer: bool):
    """ring.py's ``exchange``, timed; ``transfer=False`` (C): each receive buffer gets a local copy of
    the matching send (same tensors, real values, no communication)."""
    def exchange(group, sends, recvs):
        if not sends and not recvs:  # a step with nothing to pass on: not a transfer
            return comm.exchange(group, sends, recvs)
        started = meter.now()
        if transfer:
            return _TracedPending(trace, comm.exchange(group, sends, recvs), started)
        for (sent, _), (received, _) in zip(sends, recvs):
            received.copy_(sent)
        return _TracedPending(trace, None, started)
    return exchange


@contextmanager
def instrumented_ring(trace: meter.Recorder, *, compute: bool = True, transfer: bool = True):
    saved = ring.blocks, ring.exchange
    ring.blocks, ring.exchange = _StepBlocks(trace, compute), _exchange(trace, transfer)
    try:
        yield trace
    finally:
        ring.blocks, ring.exchange = saved


def _call(schedule, inputs, timer, kernel, trace=None):
    """One timed forward and one timed backward: {pass: seconds} (``trace``: its phase follows)."""
    q, k, v, dout = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, forward = timer(lambda: ContextParallelAttention.apply(*leaves, schedule, kernel))
    if trace is not None:
        trace.phase = "backward"
    backward = timer(lambda: out.backward(dout))[1]
    return {"forward": forward, "backward": backward}


def _twin(schedule, inputs, timer, kernel, kind):
    """A run of the ring's C or M twin: its times, and its per-step figures kept per repetition."""
    def run():
        trace = meter.Recorder("forward")
        with instrumented_ring(trace, compute=kind == COMPUTE_ONLY, transfer=kind == COMM_ONLY):
            times = _call(schedule, inputs, timer, kernel, trace)
        return times, figures.steps(trace)
    return run


def saved_bytes(schedule, inputs, kernel) -> tuple:
    """(bytes one call keeps for backward -- distinct storages --, the output); backward still runs,
    so every rank's transfers pair up."""
    q, k, v, dout = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with SavedBytes() as saved:
        out = ContextParallelAttention.apply(*leaves, schedule, kernel)
    out.backward(dout)
    return saved.total, out.detach()


def timeline(schedule, inputs, kernel) -> dict:
    """Kernel steps and transfers of one real (overlapped) ring call, forward then backward, ms since
    the forward began (rank 0's host clock)."""
    trace, (q, k, v, dout) = meter.Recorder("forward"), inputs
    dist.barrier()
    begin = meter.now()
    with instrumented_ring(trace):
        out = ContextParallelAttention.apply(*[t.clone().requires_grad_(True) for t in (q, k, v)], schedule, kernel)
        trace.phase = "backward"
        backward_began = meter.now()
        out.backward(dout)
        ended = meter.now()
    ms = lambda t: 1e3 * (t - begin)  # noqa: E731
    events = [{"kind": "compute", "pass": p, "start": ms(t0), "end": ms(t1)} for p, t0, t1 in trace.of("compute")]
    events += [{"kind": "transfer", "pass": p, "start": ms(t0), "wait": ms(tw), "end": ms(t1)}
               for p, t0, tw, t1 in trace.of("transfer")]
    return {"events": events, "backward_began": ms(backward_began), "end": ms(ended)}


def run_rank(args, device) -> dict | None:
    """Everything one rank measures at CP = world size; rank 0 returns the raw results."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    variants = variants_for(cp, args.heads, args.kv_groups)
    if args.kernel == "both":
        variants += [Variant(f"{v.name} [reference]", v.algorithm, v.window, v.ulysses, "reference") for v in variants]
    schedules = inputs_of.schedules(cp, variants, args.head_dim)
    inputs = inputs_of.local_inputs(args, cp, rank)
    whole = inputs_of.whole_inputs(args) if rank == 0 else None
    kernel_by_kind = inputs_of.kernels(args)
    kernel_of = {v.name: kernel_by_kind[v.kernel] for v in variants}
    timer = Timer(device)
    ring_variants = [v for v in variants if v.is_ring]

    engine.progress(TAG, f"CP={cp}: memory kept for backward, outputs")
    memory, outputs = {}, {}
    for variant in variants:
        memory[variant.name], outputs[variant.name] = saved_bytes(schedules[variant.name], inputs,
                                                                  kernel_of[variant.name])
    diff = {name: float((out - outputs["allgather"]).abs().max()) for name, out in outputs.items()}

    engine.progress(TAG, f"CP={cp}: auto's trials")  # the engine's tuner, no cache: decided afresh
    key = AttentionKey(args.seq, args.batch, args.heads, args.kv_groups, args.head_dim, args.dtype, True, cp, 1,
                       device.type, True, kernel_by_kind[None].name)
    choice = Tuner(CocConfig(), None).decide(key, schedules[BASELINE].cp_group, device,
                                             [v.name for v in variants if v.kernel is None], BASELINE,
                                             lambda name: _call(schedules[name], inputs, timer, kernel_of[name]), "CP")
    schedules[AUTO], memory[AUTO], diff[AUTO], kernel_of[AUTO] = (schedules[choice], memory[choice], diff[choice],
                                                                  kernel_of[choice])
    reported = [*(v.__dict__ for v in variants),
                {"name": AUTO, "algorithm": AUTO, "window": 1, "ulysses": 1, "chosen": choice}]

    runs = {name: (lambda name=name: _call(schedules[name], inputs, timer, kernel_of[name])) for name in kernel_of}
    runs[SDPA] = lambda: dict(zip(("forward", "backward"), inputs_of.sdpa_call(whole)))
    for v in ring_variants:
        for kind in (COMPUTE_ONLY, COMM_ONLY):
            runs[f"{v.name}:{kind}"] = _twin(schedules[v.name], inputs, timer, kernel_of[v.name], kind)
    times, kept = engine.measure(runs, args.reps, device=device, tag=TAG, label=f"CP={cp}: ")
    engine.progress(TAG, f"CP={cp}: timeline of one ring call")
    ring_timeline = timeline(schedules["ring"], inputs, kernel_of["ring"])

    everyone = [None] * cp
    dist.all_gather_object(everyone, {"memory": memory, "diff": diff})
    if rank != 0:
        return None
    sys.stderr.write("\n")
    return {"cp": cp, "variants": reported, "times": times, "steps": {name: kept[name] for name in kept if ":" in name},
            "ring_sizes": {v.name: schedules[v.name].ring.size for v in ring_variants},
            "memory_bytes": {v["name"]: [r["memory"][v["name"]] for r in everyone] for v in reported},
            "max_abs_diff_vs_allgather": {v["name"]: max(r["diff"][v["name"]] for r in everyone) for v in reported},
            "timeline": ring_timeline, "threads": torch.get_num_threads(), "kernel": kernel_of["ring"].name}


def add_options(parser) -> None:
    group = parser.add_argument_group("attention case (--cases attention)")
    group.add_argument("--cp", nargs="+", type=int, help="context-parallel sizes, one local rank each "
                       "(default: 2 4 on loopback, 2 with --link)")
    group.add_argument("--seq", type=int, default=2048, help="whole sequence length (default 2048: compute and "
                       "transfers of the same order over the emulated 1 gbit link, one thread per rank)")
    group.add_argument("--batch", type=int, default=1)
    group.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    group.add_argument("--kv-groups", type=int, default=8, help="key/value groups (default 8: no GQA)")
    group.add_argument("--head-dim", type=int, default=64)
    group.add_argument("--kernel", default="fused", choices=["fused", "reference", "both"],
                       help="the block kernel (default fused: the device's flash kernel); both: every algorithm "
                            "also on the reference kernel, as extra rows")


def cp_sizes(args) -> list:
    """``--cp`` checked against the shape and the link: a list of CP sizes, or SystemExit(2)."""
    sizes = args.cp or ([2] if args.link else [2, 4])
    for cp in sizes:
        if cp < 2:
            _bad(f"--cp {cp} is invalid: expected a context-parallel size >= 2")
        if args.link and cp != 2:
            _bad(f"--cp {cp} is invalid with --link: the emulated link joins exactly 2 ranks, expected --cp 2")
        if args.seq % (2 * cp):
            _bad(f"--seq {args.seq} is invalid at --cp {cp}: Megatron's layout cuts the sequence into 2*CP = "
                 f"{2 * cp} equal chunks, expected a multiple of {2 * cp}")
    for option, value in (("--seq", args.seq), ("--batch", args.batch), ("--heads", args.heads),
                          ("--kv-groups", args.kv_groups), ("--head-dim", args.head_dim), ("--reps", args.reps)):
        if value < 1:
            _bad(f"{option} {value} is invalid: expected an integer >= 1")
    if args.heads % args.kv_groups:
        _bad(f"--kv-groups {args.kv_groups} is invalid with --heads {args.heads}: expected a divisor of the heads")
    return sizes


def _bad(message: str):
    raise SystemExit(f"coc-inject bench: {message}")


def bench(args) -> int:
    """Measure every CP size, print the table and the targets, write attention.json / .png."""
    if ranks.under_torchrun():
        print("coc-inject bench: --cases attention runs on local CPU ranks (gloo) only, not under torchrun",
              file=sys.stderr)
        return 2
    sizes = cp_sizes(args)
    started = time.time()
    results = [ranks.run_local(ranks.Setup(world=cp, link=args.link, threads=args.threads, megatron=False,
                                           command="coc-inject bench --cases attention"), run_rank, args)
               for cp in sizes]
    summary = figures.summarize(results)
    where = ranks.describe_where(ranks.Setup(link=args.link, threads=args.threads),
                                 ranks="one local CPU rank per CP rank")
    title = (f"coc-inject bench attention: {where}; seq {args.seq}, batch {args.batch}, {args.heads} heads "
             f"({args.kv_groups} kv groups) x {args.head_dim}, {args.dtype}, causal, kernel {results[0]['kernel']}; "
             f"{args.reps} interleaved repetitions")
    print(title)
    print(figures.format_table(summary))
    targets = figures.targets(summary, linked=bool(args.link))
    print(figures.format_targets(targets))
    payload = {"title": title, "argv": sys.argv, "seconds": time.time() - started, "link": args.link,
               "shape": {"seq": args.seq, "batch": args.batch, "heads": args.heads, "kv_groups": args.kv_groups,
                         "head_dim": args.head_dim, "dtype": args.dtype, "causal": True, "kernel": args.kernel},
               "reps": args.reps, "targets": targets, "summary": summary, "raw": results}
    report.write(args.out, "attention", payload, figures.panels(summary, results),
                 title.replace("; seq", ";\nseq", 1), size=(6, 5), widths=[1] * len(summary) + [1.6])
    return 0
