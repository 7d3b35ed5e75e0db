"""What CoC did in this process: the route every tensor-parallel layer call took.

The engine counts each call under its route -- ``chunked`` (with the chunk count), ``fused``
(with the backend) or ``megatron`` (with the reason) -- per layer. That is one dict lookup and
one increment per call (``make bench-accounting`` measures it). From those counts:

* the **first-step summary**: one line on global rank 0 (every rank at debug level) when the
  first training step ends, defined as the first ``torch.optim.Optimizer.step()`` of the process
  (a global optimizer step hook, removed once it fired); a process that never steps an
  optimizer (inference) gets it at exit, unless it ends by an exception or SIGTERM before any
  patched layer call (then there is nothing to summarise; the report's ``ended_by`` says so).
  With it come the warnings: Transformer Engine linears in the model, no call through CoC, a
  patched ``forward`` replaced by someone else;
* the **report file** (``COC_REPORT``), written at exit, after an uncaught exception and on
  SIGTERM (torchrun stops the other ranks of a failed job that way).

Layers are named by their qualified module name in the model, found once at summary/report
time by one pass over the live ``torch.nn.Module`` objects (leading ``module.`` wrappers of
DDP / Float16Module dropped), else by class and shape.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import os
import signal
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field

from coc_inject import log, megatron_version

CHUNKED, FUSED, MEGATRON = "chunked", "fused", "megatron"
# An attention call run by coc-inject (context parallelism, or COC_FLASH_ATTN at CP = 1):
# key (CONTEXT_PARALLEL, cp size, algorithm, kernel) -- or, for a COC_FLASH_ATTN call Megatron's
# attention ran instead, (CONTEXT_PARALLEL, 1, MEGATRON_ATTENTION, reason).
CONTEXT_PARALLEL = "context-parallel"
MEGATRON_ATTENTION = "Megatron's attention"
# The start of the reason when COC_PARALLEL_NUM=auto measured Megatron's own path fastest: CoC
# stepping aside on purpose is not a "CoC did nothing" problem.
AUTO_CHOSE_MEGATRON = "auto chose Megatron's own path"
REPORT_VERSION = 1

# Tensor-parallel linear classes of Megatron's Transformer Engine spec: none subclasses the
# local layers, so CoC never sees their calls.
TE_MODULES = ("megatron.core.extensions.transformer_engine", "transformer_engine.")
TE_CLASSES = frozenset((
    "TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear",
    "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear", "TEFusedMLP",
    "TEFusedMLPWithGroupedLinear", "TELMHeadColumnParallelLinear",
))


def chunked(chunks: int) -> tuple:
    return (CHUNKED, chunks, None, None)


def fused(backend: str) -> tuple:
    return (FUSED, None, backend, None)


def megatron(reason: str) -> tuple:
    return (MEGATRON, None, None, reason)


@dataclass
class LayerRecord:
    """One layer's calls, by route key ``(route, chunks, backend, reason)``."""

    layer: weakref.ref
    cls: str
    shape: list  # [m, k, n] of its first call
    routes: dict = field(default_factory=dict)
    name: str | None = None


def _attention_kind(key) -> str:
    _, cp_size, algorithm, kernel = key
    if algorithm == MEGATRON_ATTENTION:
        return f"{algorithm} for: {kernel}"
    return (f"{algorithm}, CP={cp_size}, " if cp_size > 1 else "") + f"kernel {kernel}"


def is_foreign_linear(module) -> bool:
    cls = type(module)
    return cls.__name__ in TE_CLASSES and cls.__module__.startswith(TE_MODULES)


class Coverage:
    """Per-process accounting of layer calls (one instance per installed engine)."""

    def __init__(self, config, patched_forwards: dict):
        self.config = config
        self.patched_forwards = patched_forwards  # class -> the forward install() put there
        self.records: dict[int, LayerRecord] = {}  # by id() of the live layer
        self._retired: list[LayerRecord] = []
        self.foreign_layers: dict[str, int] = {}
        self.replaced: dict[str, str] = {}  # class name -> module.qualname of the forward now in place
        self.local_layers = 0
        self.summarized = False
        self.ended_by = None  # "exception" or "SIGTERM" when the process did not end normally (report time)
        self._lock = threading.Lock()
        self._step_hook = None
        self._report_written = False
        self._report_enabled = False  # set by arm() once the report directory is known writable
        self._previous_sigterm = None
        self.decisions = dict  # () -> {DecisionKey: Decision} of COC_PARALLEL_NUM=auto (set by install)
        self.attention_decisions = dict  # () -> {AttentionKey: Decision} of COC_CP_ALGO=auto

    # -- the hot path --------------------------------------------------------------------
    def count(self, layer, key: tuple, input_, shape_of) -> None:
        record = self.records.get(id(layer))
        if record is None or record.layer() is not layer:
            record = self._new_record(layer, input_, shape_of)
        routes = record.routes
        routes[key] = routes.get(key, 0) + 1

    def count_attention(self, layer, algorithm: str, cp_size: int, kernel: str) -> None:
        record = self.records.get(id(layer))
        if record is None or record.layer() is not layer:
            record = self._new_record(layer, None, lambda layer, input_: [])
        key = (CONTEXT_PARALLEL, cp_size, algorithm, kernel)
        record.routes[key] = record.routes.get(key, 0) + 1

    def _new_record(self, layer, input_, shape_of) -> LayerRecord:
        record = LayerRecord(weakref.ref(layer), type(layer).__name__, list(shape_of(layer, input_)))
        previous = self.records.get(id(layer))
        if previous is not None:  # a freed layer's id, reused: keep what it did
            self._retired.append(previous)
        self.records[id(layer)] = record
        return record

    def all_records(self) -> list:
        return self._retired + list(self.records.values())

    # -- totals ----------------------------------------------------------------------------
    def calls_by_route(self) -> dict:
        totals = {CHUNKED: 0, FUSED: 0, MEGATRON: 0, CONTEXT_PARALLEL: 0}
        for record in self.all_records():
            for (route, *_), calls in record.routes.items():
                totals[route] += calls
        return totals

    def coc_layers(self) -> int:
        return sum(1 for r in self.all_records() if any(key[0] in (CHUNKED, FUSED) for key in r.routes))

    def attention_summary(self) -> str | None:
        """"context parallelism on 2 attention layers (ring, CP=2, kernel cpu-flash): 4 calls" and/or
        "fused attention on 2 layers (kernel cpu-flash): 4 calls" (COC_FLASH_ATTN), None without such calls."""
        parts = []
        for title, at_cp1 in (("context parallelism on {} attention layers", False), ("fused attention on {} layers",
                                                                                      True)):
            layers, calls, kinds = 0, 0, set()
            for record in self.all_records():
                mine = {key: n for key, n in record.routes.items()
                        if key[0] == CONTEXT_PARALLEL and (key[1] == 1) == at_cp1}
                layers += bool(mine)
                calls += sum(mine.values())
                kinds.update(_attention_kind(key) for key in mine)
            if layers:
                parts.append(f"{title.format(layers)} ({'; '.join(sorted(kinds))}): {calls} calls")
        return "; ".join(parts) or None

    # -- the model: names, foreign layers, replaced forwards -----------------------------------
    def inspect_model(self) -> None:
        """One pass over the live modules: qualified names, local and TE layer counts, and
        which patched forwards someone else has replaced since install()."""
        import torch

        local_classes = tuple(self.patched_forwards)
        parents = {}
        foreign: dict[str, int] = {}
        local = 0
        gc.collect()  # layers that are garbage must not count (once per summary / report)
        # type(obj) reads no attribute of the object: isinstance() would read a foreign object's
        # __class__, which some objects warn about (torch.distributed.reduce_op: a FutureWarning
        # in every job). Whatever else a walked object says is not the user's business either.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for obj in gc.get_objects():
                cls = type(obj)
                if not issubclass(cls, torch.nn.Module):
                    continue
                for child_name, child in obj._modules.items():
                    if child is not None:
                        parents[id(child)] = (obj, child_name)
                if issubclass(cls, local_classes):
                    local += 1
                elif is_foreign_linear(obj):
                    foreign[cls.__name__] = foreign.get(cls.__name__, 0) + 1
        for record in self.records.values():
            layer = record.layer()
            if layer is not None:
                record.name = _qualified_name(layer, parents) or record.name
        # At exit the model may be gone already: keep the largest picture seen.
        for name, count in foreign.items():
            self.foreign_layers[name] = max(count, self.foreign_layers.get(name, 0))
        self.local_layers = max(local, self.local_layers)
        self.replaced = {cls.__name__: _origin(cls.__dict__.get("forward"))
                         for cls, ours in self.patched_forwards.items() if cls.__dict__.get("forward") is not ours}

    # -- the first-step summary ---------------------------------------------------------------
    def arm(self) -> None:
        """Summarise at the first optimizer step; write the report at exit (if COC_REPORT)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        path = report_path(self.config.report)
        if path is None:
            return
        directory = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            log.logger.warning("COC_REPORT=%s: directory %s does not exist or is not writable; no CoC report "
                               "will be written (the job runs on)", self.config.report, directory)
            return
        self._report_enabled = True
        atexit.register(self.write_report)
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                self._previous_sigterm = signal.SIG_DFL
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.first_step_done()

    def first_step_done(self) -> None:
        with self._lock:
            if self.summarized:
                return
            self.summarized = True
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        self.inspect_model()
        level = logging.INFO if _global_rank() == 0 else logging.DEBUG
        log.logger.log(level, self.summary_line())
        if _global_rank() == 0 or log.is_debug():
            for line in self.warnings():
                log.logger.warning(line)

    def summary_line(self) -> str:
        totals = self.calls_by_route()
        tp_layers = self.local_layers + sum(self.foreign_layers.values())
        routes = [f"{totals[CHUNKED]} chunked ({_chunk_counts(self.all_records())})" if totals[CHUNKED] else None,
                  f"{totals[FUSED]} fused" if totals[FUSED] else None,
                  f"{totals[MEGATRON]} Megatron's own" if totals[MEGATRON] else None]
        attention = self.attention_summary()
        if self.config.enabled:
            text = (f"first step: CoC on {self.coc_layers()} of {tp_layers} TP linear layers; layer calls: "
                    + (", ".join(r for r in routes if r) or "none")) + (f"; {attention}" if attention else "")
        else:
            text = f"first step: {attention or 'no attention call ran with context parallelism'} (TP linears: CoC off)"
        reasons = {}
        for record in self.all_records():
            for (route, _, _, reason), calls in record.routes.items():
                if route == MEGATRON:
                    reasons[reason] = reasons.get(reason, 0) + calls
        if reasons:
            text += "; Megatron's path because: " + "; ".join(f"{why} ({n} calls)" for why, n in reasons.items())
        return text

    def warnings(self) -> list:
        lines = []
        if self.foreign_layers:
            counts = ", ".join(f"{n} {name}" for name, n in sorted(self.foreign_layers.items()))
            lines.append(f"the model has tensor-parallel linears of Transformer Engine classes ({counts}) that "
                         "CoC does not see: CoC covers Megatron's local layers (--transformer-impl local); "
                         "Transformer Engine has its own overlap (--tp-comm-overlap)")
        totals = self.calls_by_route()
        reasons = {key[3] for r in self.all_records() for key in r.routes if key[0] == MEGATRON}
        auto_stepped_aside = bool(reasons) and all(reason.startswith(AUTO_CHOSE_MEGATRON) for reason in reasons)
        if self.config.cp_algo is not None and not totals[CONTEXT_PARALLEL]:
            lines.append(f"COC_CP_ALGO={self.config.cp_algo} but no attention call ran with context parallelism "
                         "during the first step (context_parallel_size 1, or no local DotProductAttention)")
        fused_at_cp1 = any(key[0] == CONTEXT_PARALLEL and key[1] == 1 and key[2] != MEGATRON_ATTENTION
                           for r in self.all_records() for key in r.routes)
        if self.config.flash_attn and not self.config.disabled and not fused_at_cp1:
            lines.append("COC_FLASH_ATTN=1 but no attention call ran the fused kernel at CP = 1 during the first step "
                         "(no local DotProductAttention built with CP = 1, or Megatron's path for every call: see "
                         "the warnings above)")
        if self.config.enabled and totals[CHUNKED] + totals[FUSED] == 0 and not auto_stepped_aside:
            lines.append("CoC is on but no layer call went through it during the first step"
                         + (" (see the reasons above)" if totals[MEGATRON] else " (no patched layer was called)"))
        for name, origin in sorted(self.replaced.items()):
            lines.append(f"{name}.forward was replaced after coc-inject patched it (now: {origin}): CoC is NOT "
                         f"active for {name}")
        return lines

    # -- the report file ----------------------------------------------------------------------
    def report(self) -> dict:
        layers = []
        for record in self.all_records():
            for (route, chunks, backend, reason), calls in record.routes.items():
                if route == CONTEXT_PARALLEL:
                    megatron_instead = backend == MEGATRON_ATTENTION
                    layers.append({"name": record.name or record.cls, "class": record.cls, "shape": record.shape,
                                   "route": route, "algorithm": backend, "cp_size": chunks, "chunks": None,
                                   "backend": None, "kernel": None if megatron_instead else reason,
                                   "reason": reason if megatron_instead else None, "calls": calls})
                    continue
                layers.append({
                    "name": record.name or f"{record.cls}[{record.shape[1]}x{record.shape[2]}]",
                    "class": record.cls, "shape": record.shape, "route": route, "chunks": chunks,
                    "backend": backend, "reason": reason, "calls": calls,
                })
        return {
            "version": REPORT_VERSION,
            "rank": _global_rank(),
            "world_size": int(os.environ.get("WORLD_SIZE", "1")),
            "pid": os.getpid(),
            "megatron_core": megatron_version.imported().version,
            "config": self.config.describe(),
            "first_step_summarized": self.summarized,
            "ended_by": self.ended_by,
            "calls": self.calls_by_route(),
            "layers": layers,
            "local_layers": self.local_layers,
            "foreign_layers": dict(sorted(self.foreign_layers.items())),
            "replaced_forwards": dict(sorted(self.replaced.items())),
            "auto_decisions": [
                {"key": key.text(), "case": key.case, "shape": [key.m, key.k, key.n], "dtype": key.dtype,
                 "chunks": decision.chunks, "source": decision.source,
                 "times_ms": {str(c): round(t, 4) for c, t in decision.times_ms.items()}}
                for key, decision in self.decisions().items()],
            "attention_decisions": [
                {"key": key.text(), "algorithm": decision.choice, "source": decision.source,
                 "times_ms": {str(c): round(t, 4) for c, t in decision.times_ms.items()}}
                for key, decision in self.attention_decisions().items()],
        }

    def ended_before_any_call(self) -> bool:
        """Did the process end abnormally before its first step and before any patched layer call?
        Then a summary would only print "0 of 0 ... none" and a no-call warning after the traceback,
        as if CoC had failed: it is left out (the report says ``ended_by``)."""
        return self.ended_by is not None and not self.summarized and not any(r.routes for r in self.all_records())

    def _on_sigterm(self, signum, frame):
        self.ended_by = "SIGTERM"
        self.write_report()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def disarm(self) -> None:
        """Undo arm() (uninstall)."""
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        atexit.unregister(self.write_report)
        if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def write_report(self) -> str | None:
        """Write the report once (at exit); a failure is one warning, never an exception."""
        path = report_path(self.config.report)
        if path is None or not self._report_enabled or self._report_written:
            return None
        self._report_written = True
        try:
            if self.ended_by is None and _ended_by_exception():
                self.ended_by = "exception"
            if not self.summarized and not self.ended_before_any_call():
                self.first_step_done()  # no optimizer step: summarise what happened
            else:
                self.inspect_model()
            text = json.dumps(self.report(), indent=1, default=str) + "\n"
            temporary = f"{path}.tmp{os.getpid()}"
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(text)
            os.replace(temporary, path)
            return path
        except Exception as error:  # the report must never stop or fail the job
            log.logger.warning("cannot write the CoC report %s (COC_REPORT): %s", path, error)
            return None


def report_path(template: str | None, rank: int | None = None) -> str | None:
    """The file this rank writes: ``{rank}`` replaced by the global rank; without ``{rank}``
    only global rank 0 writes (None for the others)."""
    if not template:
        return None
    rank = _global_rank() if rank is None else rank
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None


def _ended_by_exception() -> bool:
    """At exit: did an uncaught exception end the process? (Python keeps it in sys.last_value /
    sys.last_exc once it has printed the traceback, before the atexit handlers run.)"""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None


def _global_rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _origin(function) -> str:
    if function is None:
        return "nothing (forward deleted)"
    module = getattr(function, "__module__", None) or type(function).__module__
    return f"{module}.{getattr(function, '__qualname__', type(function).__name__)}"


def _qualified_name(layer, parents: dict) -> str | None:
    parts = []
    node = layer
    seen = set()
    while id(node) in parents and id(node) not in seen:
        seen.add(id(node))
        node, name = parents[id(node)]
        parts.append(name)
    if not parts:
        return None
    parts.reverse()
    while len(parts) > 1 and parts[0] == "module":  # DDP / Float16Module wrappers
        parts.pop(0)
    return ".".join(parts)


def _chunk_counts(records) -> str:
    counts = sorted({key[1] for r in records for key in r.routes if key[0] == CHUNKED})
    return "N=" + "/".join(map(str, counts))
