"""``coc-inject bench --cases attention``: the context-parallel core attention, every algorithm.

ContextParallelAttention (make_schedule; causal, Megatron's 2*CP chunk layout, --dtype, the
--kernel block kernel) forward and backward on local CPU ranks (gloo): CP=2 (and CP=4 on
loopback), over plain loopback or the emulated link. Each repetition runs every variant once, in a
rotating order:

* the algorithms the shape allows: ring, ulysses, allgather; at CP=4 also Double-Ring (ring,
  window 2) and hybrid (Ulysses degree 2 inside, ring across);
* ``C``: a ring variant with its transfers replaced by a local copy of the same tensors -- the
  block kernel on the same block plans, every step, no communication;
* ``M``: the same ring with the block kernel skipped -- its transfers alone, in its order;
* ``sdpa``: the yardstick -- torch's ``scaled_dot_product_attention`` on the whole sequence in one
  process (rank 0, the other ranks wait), what a user runs without context parallelism;
* with ``--kernel both``, every algorithm again on the reference kernel (``name [reference]``).

ring.py is instrumented from outside, by swapping its ``blocks`` and ``exchange`` names for a
call (nothing changes in the library, nothing costs when the bench is not running): each
kernel step and each transfer (start, wait, done) is timestamped. That gives the per-step C and
M of the step-wise pipelining ideal, and the timeline of one ring call.

Rank 0 returns raw per-repetition times; figures are made by coc_inject.bench.attention_report.
"""

from __future__ import annotations

import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coc_inject.bench import attention_inputs, attention_report as report, ranks
from coc_inject.bench.layers import Timer
from coc_inject.bench.ranks import Setup
from coc_inject.bench.saved import SavedBytes
from coc_inject.config import CocConfig
from coc_inject.context_parallel import blocks, comm, ring
from coc_inject.context_parallel.auto import BASELINE, AttentionKey
from coc_inject.context_parallel.function import ContextParallelAttention
from coc_inject.tuning.online import Tuner

CASES = ("attention",)
WARMUP = 1  # untimed repetitions before the timed ones
COMPUTE_ONLY, COMM_ONLY = "C", "M"
SDPA = "sdpa"


@dataclass(frozen=True)
class Variant:
    name: str
    algorithm: str
    window: int = 1
    ulysses: int = 1
    kernel: str | None = None  # None: the bench's --kernel; "reference": an extra row of --kernel both

    @property
    def is_ring(self) -> bool:
        return self.algorithm == "ring" and self.kernel is None


def variants_for(cp: int, heads: int, groups: int) -> list:
    """Every algorithm this shape allows at ``cp``: Ulysses needs heads and key/value groups
    divisible by its degree; Double-Ring a window strictly between 1 and the ring size."""
    variants = [Variant("ring", "ring")]
    if cp >= 4 and cp % 2 == 0:
        variants.append(Variant("double-ring w=2", "ring", window=2))
    if heads % cp == 0 and groups % cp == 0:
        variants.append(Variant("ulysses", "ulysses"))
    if cp >= 4 and cp % 2 == 0 and heads % 2 == 0 and groups % 2 == 0:
        variants.append(Variant("hybrid u=2", "hybrid", ulysses=2))
    variants.append(Variant("allgather", "allgather"))
    return variants


# -- instrumentation of ring.py ----------------------------------------------------------------


class _Trace:
    """Timestamps (perf_counter seconds) of one call's kernel steps and transfers."""

    def __init__(self):
        self.compute = []  # (pass, t0, t1) per blocks.forward / blocks.backward call
        self.transfers = []  # (pass, started, wait began, done) per exchange
        self.phase = "forward"


class _StepBlocks:
    """Stands in for ring.py's ``blocks`` module: times each kernel step, or skips it (M)."""

    def __init__(self, trace: _Trace, run: bool):
        self._real, self._trace, self._run = blocks, trace, run

    def _step(self, fn, *args):
        begin = time.perf_counter()
        if self._run:
            fn(*args)
        self._trace.compute.append((self._trace.phase, begin, time.perf_counter()))

    def forward(self, *args):
        self._step(self._real.forward, *args)

    def backward(self, *args):
        self._step(self._real.backward, *args)


class _TracedPending:
    def __init__(self, trace: _Trace, pending, started: float):
        self._trace, self._pending, self._started = trace, pending, started

    def wait(self) -> None:
        waiting = time.perf_counter()
        if self._pending is not None:
            self._pending.wait()
        self._trace.transfers.append((self._trace.phase, self._started, waiting, time.perf_counter()))


def _exchange(trace: _Trace, transfer: bool):
    """ring.py's ``exchange``, timed; ``transfer=False`` (C): each receive buffer gets a local copy
    of the matching send (same tensors, real values, no communication)."""
    def exchange(group, sends, recvs):
        if not sends and not recvs:  # a step with nothing to pass on: not a transfer
            return comm.exchange(group, sends, recvs)
        started = time.perf_counter()
        if transfer:
            return _TracedPending(trace, comm.exchange(group, sends, recvs), started)
        for (sent, _), (received, _) in zip(sends, recvs):
            received.copy_(sent)
        return _TracedPending(trace, None, started)

    return exchange


@contextmanager
def instrumented_ring(trace: _Trace, *, compute: bool = True, transfer: bool = True):
    saved = ring.blocks, ring.exchange
    ring.blocks, ring.exchange = _StepBlocks(trace, compute), _exchange(trace, transfer)
    try:
        yield trace
    finally:
        ring.blocks, ring.exchange = saved


# -- one rank ----------------------------------------------------------------------------------


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        sys.stderr.write(f"\r[coc-inject bench attention] {message:<70}")
        sys.stderr.flush()


def _call(schedule, inputs, timer, kernel):
    """One timed forward and one timed backward: (forward s, backward s, output)."""
    q, k, v, dout = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, forward = timer(lambda: ContextParallelAttention.apply(*leaves, schedule, kernel))
    _, backward = timer(lambda: out.backward(dout))
    return forward, backward, out.detach()


def _traced_call(schedule, inputs, timer, kernel, *, compute=True, transfer=True):
    trace = _Trace()
    with instrumented_ring(trace, compute=compute, transfer=transfer):
        q, k, v, dout = inputs
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out, forward = timer(lambda: ContextParallelAttention.apply(*leaves, schedule, kernel))
        trace.phase = "backward"
        _, backward = timer(lambda: out.backward(dout))
    return forward, backward, trace


def _steps(trace: _Trace) -> dict:
    """Per pass: each kernel step's duration, each transfer's (start to done), and the time some
    transfer was in flight (union of those intervals: Double-Ring's overlap counted once)."""
    figures = {}
    for phase in ("forward", "backward"):
        compute = [t1 - t0 for p, t0, t1 in trace.compute if p == phase]
        spans = sorted((t0, t1) for p, t0, _, t1 in trace.transfers if p == phase)  # in start order
        union, reach = 0.0, -math.inf
        for t0, t1 in spans:
            union += max(0.0, t1 - max(t0, reach))
            reach = max(reach, t1)
        figures[phase] = {"compute_steps": compute, "transfers": [t1 - t0 for t0, t1 in spans],
                          "in_flight": union}
    return figures


def saved_bytes(schedule, inputs, kernel) -> tuple:
    """(bytes kept for backward by one call -- distinct storages through saved_tensors_hooks --,
    the output) ; backward still runs, so every rank's transfers pair up."""
    q, k, v, dout = inputs
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with SavedBytes() as saved:
        out = ContextParallelAttention.apply(*leaves, schedule, kernel)
    out.backward(dout)
    return saved.total, out.detach()


def timeline(schedule, inputs, timer, kernel) -> list:
    """Kernel steps and transfers of one real (overlapped) ring call, forward then backward,
    ms since the forward began (rank 0's host clock)."""
    trace = _Trace()
    dist.barrier()
    begin = time.perf_counter()
    with instrumented_ring(trace):
        q, k, v, dout = inputs
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = ContextParallelAttention.apply(*leaves, schedule, kernel)
        trace.phase = "backward"
        backward_began = time.perf_counter()
        out.backward(dout)
        ended = time.perf_counter()
    ms = lambda t: 1e3 * (t - begin)  # noqa: E731
    events = [{"kind": "compute", "pass": p, "start": ms(t0), "end": ms(t1)} for p, t0, t1 in trace.compute]
    events += [{"kind": "transfer", "pass": p, "start": ms(t0), "wait": ms(tw), "end": ms(t1)}
               for p, t0, tw, t1 in trace.transfers]
    return {"events": events, "backward_began": ms(backward_began), "end": ms(ended)}


AUTO = "auto"


def _auto_choice(schedules, variants, inputs, timer, args, cp, device) -> str:
    """COC_CP_ALGO=auto's decision for this shape, made by the engine's own tuner (trials forward
    and backward, MAX over the ranks, the noise rule against ring); no cache: decided afresh."""
    kernel = attention_inputs.kernels(args)[None]
    key = AttentionKey(args.seq, args.batch, args.heads, args.kv_groups, args.head_dim, args.dtype, True, cp, 1,
                       device.type, True, kernel.name)
    return Tuner(CocConfig(), None).decide(key, schedules[BASELINE].cp_group, device,
                                           [v.name for v in variants if v.kernel is None], BASELINE,
                                           lambda name: _call(schedules[name], inputs, timer, kernel), "CP")


def run_rank(args, device) -> dict | None:
    """Everything one rank measures at CP = world size; rank 0 returns the raw results."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    variants = variants_for(cp, args.heads, args.kv_groups)
    if args.kernel == "both":
        variants += [Variant(f"{v.name} [reference]", v.algorithm, v.window, v.ulysses, "reference") for v in variants]
    schedules = attention_inputs.schedules(cp, variants, args.head_dim)
    inputs = attention_inputs.local_inputs(args, cp, rank)
    whole = attention_inputs.whole_inputs(args) if rank == 0 else None
    kernel_by_kind = attention_inputs.kernels(args)
    kernel_of = {v.name: kernel_by_kind[v.kernel] for v in variants}
    timer = Timer(device)
    ring_variants = [v for v in variants if v.is_ring]

    progress(f"CP={cp}: memory kept for backward, outputs")
    memory, outputs = {}, {}
    for variant in variants:  # also the warm-up of every variant
        memory[variant.name], outputs[variant.name] = saved_bytes(schedules[variant.name], inputs,
                                                                  kernel_of[variant.name])
    diff = {name: float((out - outputs["allgather"]).abs().max()) for name, out in outputs.items()}

    progress(f"CP={cp}: auto's trials")
    choice = _auto_choice(schedules, variants, inputs, timer, args, cp, device)
    schedules[AUTO], memory[AUTO], diff[AUTO] = schedules[choice], memory[choice], diff[choice]
    kernel_of[AUTO] = kernel_of[choice]
    reported = [*(v.__dict__ for v in variants),
                {"name": AUTO, "algorithm": AUTO, "window": 1, "ulysses": 1, "chosen": choice}]

    runs = [(v.name, None) for v in variants] + [(AUTO, None), (SDPA, None)]
    runs += [(v.name, kind) for v in ring_variants for kind in (COMPUTE_ONLY, COMM_ONLY)]
    times = {f"{name}:{kind}" if kind else name: {"forward": [], "backward": []} for name, kind in runs}
    steps = {f"{v.name}:{kind}": [] for v in ring_variants for kind in (COMPUTE_ONLY, COMM_ONLY)}
    for rep in range(WARMUP + args.reps):
        timed = rep >= WARMUP
        progress(f"CP={cp}: repetition {rep + 1 - WARMUP}/{args.reps}" if timed else f"CP={cp}: warm-up")
        shift = rep % len(runs)
        for name, kind in runs[shift:] + runs[:shift]:
            label = f"{name}:{kind}" if kind else name
            if name == SDPA:
                forward, backward = attention_inputs.sdpa_call(whole)
            elif kind is None:
                forward, backward, _ = _call(schedules[name], inputs, timer, kernel_of[name])
            else:
                forward, backward, trace = _traced_call(schedules[name], inputs, timer, kernel_of[name],
                                                        compute=kind == COMPUTE_ONLY, transfer=kind == COMM_ONLY)
                if timed:
                    steps[label].append(_steps(trace))
            if timed:
                times[label]["forward"].append(forward)
                times[label]["backward"].append(backward)
    progress(f"CP={cp}: timeline of one ring call")
    ring_timeline = timeline(schedules["ring"], inputs, timer, kernel_of["ring"])

    everyone = [None] * cp
    dist.all_gather_object(everyone, {"memory": memory, "diff": diff})
    if rank != 0:
        return None
    sys.stderr.write("\n")
    return {"cp": cp, "variants": reported, "times": times, "steps": steps,
            "ring_sizes": {v.name: schedules[v.name].ring.size for v in ring_variants},
            "memory_bytes": {v["name"]: [r["memory"][v["name"]] for r in everyone] for v in reported},
            "max_abs_diff_vs_allgather": {v["name"]: max(r["diff"][v["name"]] for r in everyone) for v in reported},
            "timeline": ring_timeline, "threads": torch.get_num_threads(), "kernel": kernel_of["ring"].name}


# -- the command -------------------------------------------------------------------------------


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
    results = [ranks.run_local(Setup(world=cp, link=args.link, threads=args.threads, megatron=False,
                                     command="coc-inject bench --cases attention"), run_rank, args)
               for cp in sizes]
    summary = report.summarize(results)
    where = ranks.describe_where(Setup(link=args.link, threads=args.threads), ranks="one local CPU rank per CP rank")
    title = (f"coc-inject bench attention: {where}; seq {args.seq}, batch {args.batch}, {args.heads} heads "
             f"({args.kv_groups} kv groups) x {args.head_dim}, {args.dtype}, causal, kernel {results[0]['kernel']}; "
             f"{args.reps} interleaved repetitions")
    print(title)
    print(report.format_table(summary))
    targets = report.targets(summary, linked=bool(args.link))
    print(report.format_targets(targets))
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "argv": sys.argv, "seconds": time.time() - started, "link": args.link,
               "shape": {"seq": args.seq, "batch": args.batch, "heads": args.heads, "kv_groups": args.kv_groups,
                         "head_dim": args.head_dim, "dtype": args.dtype, "causal": True, "kernel": args.kernel},
               "reps": args.reps, "targets": targets, "summary": summary, "raw": results}
    report.write_json(args.out / "attention.json", payload)
    problem = report.write_png(args.out / "attention.png", summary, results, title)
    written = f"; {problem}" if problem else f" and {args.out / 'attention.png'}"
    print(f"wrote {args.out / 'attention.json'}{written}")
    return 0
