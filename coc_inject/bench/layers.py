"""Rank-side measurements: real Megatron layers unpatched vs through the injector.

Runs inside each rank (spawned locally, or under torchrun on real devices). Rank 0 returns
the raw per-repetition times; every timed region starts after a barrier so ranks line up.

Variants: unpatched Megatron, each fixed chunk count ``N=c``, and ``auto``
(``COC_PARALLEL_NUM=auto`` with a fresh tune cache): its decision -- the engine's own trials
-- is made by one untimed call before the repetitions, and every timed ``auto`` call then
reuses that decision (the engine's tuner is carried across the per-variant re-installs), so
the timed repetitions measure the decided path, never trials or a cache look-up.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from coc_inject import patching
from coc_inject.config import AUTO, CocConfig
from coc_inject.pipeline import collectives, schedules
from coc_inject.routes import LayerCase


@dataclass(frozen=True)
class BenchCase:
    name: str
    kind: str  # "row" | "column"
    sequence_parallel: bool
    label: str
    collective: str  # the forward collective, for the comm-only measurement


CASES = {
    case.name: case
    for case in (
        BenchCase(LayerCase.ROW, "row", False, "Row mm+AR", "all_reduce"),
        BenchCase(LayerCase.ROW_SP, "row", True, "Row SP mm+RS", "reduce_scatter"),
        BenchCase(LayerCase.COLUMN_SP, "column", True, "Column SP AG+mm", "all_gather"),
        BenchCase(LayerCase.COLUMN_BWD, "column", False, "Column dgrad+AR (bwd)", "none"),
    )
}
DEFAULT_CASES = (LayerCase.ROW, LayerCase.ROW_SP, LayerCase.COLUMN_SP)
AUTO_VARIANT = "auto"


class Timer:
    """Wall time of a region on every rank, device-synchronised (CUDA/NPU events where present)."""

    def __init__(self, device: torch.device):
        self.device = device
        module = getattr(torch, device.type, None)
        self.events = module if device.type in ("cuda", "npu") and hasattr(module, "Event") else None

    def __call__(self, fn):
        dist.barrier()
        if self.events is not None:
            start, end = self.events.Event(enable_timing=True), self.events.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return result, start.elapsed_time(end) / 1e3
        begin = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - begin


def build_layer(case: BenchCase, m: int, k: int, n: int, dtype, device, batch: int = 1):
    """Layer whose forward matmul is [m, k] x [k, n] on each rank (k, n: per-rank sizes), and
    its input: ``[m / batch, batch, k]`` (Column SP: this rank's shard, ``[m / (batch*TP), batch, k]``).

    [m, k, n] is the shape the engine keys ``customized_coc`` and ``auto`` decisions by."""
    from megatron.core import parallel_state  # Megatron: not imported by coc-inject bench's --help and errors
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=case.sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=dtype,
                                 gradient_accumulation_fusion=False)
    init = torch.nn.init.xavier_normal_
    if case.kind == "row":
        layer = RowParallelLinear(k * tp, n, config=config, init_method=init, bias=False,
                                  input_is_parallel=True, skip_bias_add=True)
        rows = m
    else:
        layer = ColumnParallelLinear(k, n * tp, config=config, init_method=init, bias=False)
        rows = m // tp if case.sequence_parallel else m
    layer = layer.to(device)
    x = torch.randn(rows // batch, batch, k, dtype=dtype, device=device)
    return layer, x


def auto_config(tune_cache: str | None) -> CocConfig:
    """The bench's ``auto`` variant: ``COC_PARALLEL_NUM=auto`` (default candidates) with ``tune_cache``."""
    return CocConfig(parallel_num=AUTO, enable_coc_in_column_backward=True, tune_cache=tune_cache)


def _install(variant: str, layer=None, auto=None) -> None:
    """Patch for ``variant``; with ``layer``, also run the one-time cross-rank config check
    now, so that no timed call pays for it. ``auto``: (config, tuner) of the ``auto`` variant;
    a tuner is handed to the new engine, so calls reuse its decisions."""
    patching.uninstall()
    if variant == "megatron":
        return
    if variant == AUTO_VARIANT:
        config, tuner = auto
        patching.install(config)
        patching.engine().tuner = tuner
        if layer is not None:
            patching.engine().ensure_agreement(layer.tp_group, layer.weight.device)
        return
    chunks = int(variant.split("=")[1])
    if chunks == 1:
        # Patched layers with 1 chunk run Megatron's own path behind our wrapper: the
        # wrapper's cost. (A config needs one CoC shape to be "on"; (1, 1, 1) never matches.)
        patching.install(CocConfig(parallel_num=1, customized_coc={(1, 1, 1): 2}))
    else:
        patching.install(CocConfig(parallel_num=chunks, enable_coc_in_column_backward=True))
    if layer is not None:
        patching.engine().ensure_agreement(layer.tp_group, layer.weight.device)


def _comm_only(case: BenchCase, layer, x, group):
    tp = group.size()
    rows = x.shape[0] * x.shape[1]
    if case.collective == "all_reduce":
        buffer = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device)
        return lambda: dist.all_reduce(buffer, group=group)
    if case.collective == "reduce_scatter":
        full = torch.empty(rows, layer.output_size, dtype=x.dtype, device=x.device)
        shard = torch.empty(rows // tp, layer.output_size, dtype=x.dtype, device=x.device)
        return lambda: dist.reduce_scatter_tensor(shard, full, group=group)
    if case.collective == "all_gather":
        local = x.reshape(rows, -1)
        full = torch.empty(rows * tp, local.shape[1], dtype=x.dtype, device=x.device)
        return lambda: dist.all_gather_into_tensor(full, local, group=group)
    return None


def progress(message: str) -> None:
    if dist.get_rank() == 0:
        sys.stderr.write(f"\r[coc-inject bench] {message:<78}")
        sys.stderr.flush()


def decide_auto(layer, x, config) -> tuple:
    """One untimed forward+backward with ``auto`` installed: the engine's tuner decides this
    layer's key (trials, or the cache). Returns (tuner, decision key, decision)."""
    _install(AUTO_VARIANT, layer, (config, None))
    try:
        inp = x.clone().requires_grad_(True)
        out, _ = layer(inp)
        out.backward(torch.ones_like(out))
        layer.zero_grad(set_to_none=True)
        tuner = patching.engine().tuner
    finally:
        patching.uninstall()
    if tuner is None or len(tuner.decisions) != 1:
        raise RuntimeError(f"auto made {0 if tuner is None else len(tuner.decisions)} decisions for one layer "
                           "call, expected 1 (did the call fall back to Megatron before tuning?)")
    (key, decision), = tuner.decisions.items()
    return tuner, key, decision


def decision_record(key, decision) -> dict:
    """JSON-able: the decided N, where it came from, the trials' median times (ms) and noise."""
    return {"chunks": decision.chunks, "source": decision.source, "key": key.text(),
            "times_ms": {str(c): t for c, t in sorted(decision.times_ms.items())},
            "noise_ms": decision.noise_ms}


def measure_case(case: BenchCase, *, m, k, n, dtype, device, chunks, reps, warmup=1, tune_cache=None) -> dict:
    """``chunks``: chunk counts and/or ``"auto"``; ``tune_cache``: the auto variant's (fresh) cache."""
    layer, x = build_layer(case, m, k, n, dtype, device)
    timer = Timer(device)
    fixed = [c for c in chunks if c != AUTO_VARIANT]
    variants = ["megatron"] + [f"N={c}" for c in fixed]
    auto, decided = None, None
    if AUTO_VARIANT in chunks:
        progress(f"{case.label}: auto trials")
        config = auto_config(tune_cache)
        tuner, key, decision = decide_auto(layer, x, config)
        auto, decided = (config, tuner), decision_record(key, decision)
        decided["coc_calls"] = []  # per timed repetition: CoC calls the auto variant made (0: Megatron's path)
        variants.append(AUTO_VARIANT)
    rows_in = torch.randn(m, k, dtype=dtype, device=device)  # the forward matmul's [m, k] operand
    compute = lambda: torch.matmul(rows_in, layer.weight.t())  # noqa: E731
    comm = _comm_only(case, layer, x, layer.tp_group)
    times = {v: {"forward": [], "backward": []} for v in variants}
    times["compute-only"], times["comm-only"] = {"forward": []}, {"forward": []}
    for rep in range(warmup + reps):
        progress(f"{case.label}: repetition {rep + 1 - warmup}/{reps}" if rep >= warmup else f"{case.label}: warm-up")
        shift = rep % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            _install(variant, layer, auto)
            inp = x.clone().requires_grad_(True)
            (out, _), forward = timer(lambda: layer(inp))
            grad = torch.ones_like(out)
            _, backward = timer(lambda: out.backward(grad))
            layer.zero_grad(set_to_none=True)
            if variant == AUTO_VARIANT:
                _check_auto_reused(auto[1], decided)
            if rep >= warmup:
                times[variant]["forward"].append(forward)
                times[variant]["backward"].append(backward)
                if variant == AUTO_VARIANT:
                    decided["coc_calls"].append(patching.engine().calls)
        patching.uninstall()
        _, compute_time = timer(compute)
        comm_time = timer(comm)[1] if comm is not None else 0.0
        if rep >= warmup:
            times["compute-only"]["forward"].append(compute_time)
            times["comm-only"]["forward"].append(comm_time)
    shown = max(fixed) if fixed else max(decided["chunks"], 2)
    result = {"case": case.name, "label": case.label, "times": times, "timeline": timeline(layer, x, shown)}
    if decided is not None:
        result["auto"] = decided
    return result


def _check_auto_reused(tuner, decided) -> None:
    """The timed auto calls must run the decision made before the repetitions, nothing new."""
    if len(tuner.decisions) != 1 or next(iter(tuner.decisions.values())).chunks != decided["chunks"]:
        raise RuntimeError("auto made a new decision during the timed repetitions: "
                           f"{[d.describe(k) for k, d in tuner.decisions.items()]}")


def timeline(layer, x, chunks: int) -> list:
    """Per-chunk compute and communication intervals of one CoC forward (host clock, ms)."""
    _install(f"N={chunks}", layer)
    tracer = schedules.TimelineTracer()
    schedules.tracer = tracer
    try:
        dist.barrier()
        begin = time.perf_counter()
        layer(x.clone())
        dist.barrier()
    finally:
        schedules.tracer = None
        patching.uninstall()
    return [(kind, start_row, 1e3 * (t0 - begin), 1e3 * (t1 - begin))
            for kind, start_row, t0, t1 in tracer.finish() if kind != "launch"]


def _median_seconds(fn, calls: int) -> float:
    samples = []
    for _ in range(calls):
        begin = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def host_overhead_per_chunk(device, dtype, rows_per_chunk: int = 8, calls: int = 300) -> dict:
    """Host time each extra chunk costs, on tiny shapes (Row mm+AR, 8 rows per chunk, 32x32).

    * ``pipeline_us``: coc-inject's own work per chunk (slicing, bookkeeping, schedule): the
      slope of the forward time over N = 2 -> 16 with the collective launch stubbed out,
      minus one chunk's matmul;
    * ``collective_launch_us``: the backend's cost to start one async collective (measured
      alone), which every extra chunk also pays;
    * ``total_us``: their sum.
    """
    def forward_time(chunks):
        layer, x = build_layer(CASES[LayerCase.ROW], rows_per_chunk * chunks, 32, 32, dtype, device)
        _install(f"N={chunks}")
        try:
            layer(x)  # the one-time config agreement happens here, with the real collective
            real, collectives.all_reduce_async = collectives.all_reduce_async, lambda tensor, group: None
            try:
                with torch.no_grad():
                    return _median_seconds(lambda: layer(x), calls)
            finally:
                collectives.all_reduce_async = real
        finally:
            patching.uninstall()

    low, high = 2, 16
    slope = (forward_time(high) - forward_time(low)) / (high - low)
    chunk = torch.randn(rows_per_chunk, 32, dtype=dtype, device=device)
    weight_t = torch.randn(32, 32, dtype=dtype, device=device).t()
    out = torch.empty(rows_per_chunk, 32, dtype=dtype, device=device)
    matmul = _median_seconds(lambda: torch.matmul(chunk, weight_t, out=out), calls)
    launches = []
    for _ in range(calls // 10):
        dist.barrier()
        begin = time.perf_counter()
        handles = [collectives.all_reduce_async(chunk, None) for _ in range(8)]
        launches.append((time.perf_counter() - begin) / 8)
        collectives.wait_all(handles)
    pipeline_us = 1e6 * (slope - matmul)
    launch_us = 1e6 * statistics.median(launches)
    return {"pipeline_us": pipeline_us, "collective_launch_us": launch_us,
            "total_us": pipeline_us + launch_us, "rows_per_chunk": rows_per_chunk}
