"""What CoC did in this process: the route every tensor-parallel layer, attention, block and MoE call took.

The engine and the attention hook count each call under its route (:mod:`coc_inject.routes`)
per layer, the calls of ``auto``'s trials apart; from the job's counts come the first-step
summary with its warnings and the COC_REPORT file. The parts:

* :mod:`.counting`: the per-call counts (the hot path);
* :mod:`.model`: one pass over the live modules at summary / report time (layer names, local
  and Transformer Engine linears, replaced forwards);
* :mod:`.tree`: the modules built since Megatron's import, held weakly (the first step's pass);
* :mod:`.reporting`: the summary line, the warnings and the report's schema;
* :mod:`.ending`: when they are said or written (first optimizer step, exit, exception, SIGTERM).
"""

from __future__ import annotations

from coc_inject.coverage import reporting
from coc_inject.coverage.counting import Counts, LayerRecord
from coc_inject.coverage.ending import ProcessEnd, report_path
from coc_inject.coverage.model import ModelView, is_foreign_linear, qualified_name
from coc_inject.coverage.reporting import REPORT_VERSION

__all__ = ["REPORT_VERSION", "Coverage", "LayerRecord", "is_foreign_linear",
           "qualified_name", "report_path"]


class Coverage(Counts):
    """Per-process accounting of layer calls (one per installation)."""

    def __init__(self, config, patched_forwards: dict):
        super().__init__()
        self.config = config
        self.model = ModelView(patched_forwards)
        self.ending = ProcessEnd(self)
        self.decisions = dict  # () -> {DecisionKey: Decision} of COC_PARALLEL_NUM=auto (set by the installation)
        self.attention_decisions = dict  # () -> {AttentionKey: Decision} of COC_CP_ALGO=auto
        self.copies_decisions = dict  # () -> {CopiesKey: Decision} of COC_MULTI_COPY=auto
        self.moe_decisions = dict  # () -> {MoEKey: Decision} of COC_MOE_OVERLAP=auto
        self.communication = lambda: None  # () -> the meter's report (COC_MEASURE), set by its installation
        self.taken_over = list  # () -> Patches.taken_over(): attributes another patcher set after coc-inject's
        self.tracker = None  # coverage.tree.ModuleTracker of the installation, where it has one

    def inspect_model(self, walk: bool = False) -> None:
        """``walk``: from the heap's objects even where the tracker could say (the report at exit: it also
        counts half-built modules, which no tracker sees)."""
        records = [*self.job.records.values(), *self.trials.records.values()]
        self.model.inspect(records, None if walk else self.tracker)

    def summary_line(self) -> str:
        return reporting.summary_line(self)

    def attention_summary(self) -> str | None:
        return reporting.attention_summary(self)

    def warnings(self) -> list:
        return reporting.warnings(self)

    def report(self) -> dict:
        return reporting.report(self)

    def arm(self) -> None:
        self.ending.arm()

    def disarm(self) -> None:
        self.ending.disarm()

    def first_step_done(self) -> None:
        self.ending.first_step_done()

    def write_report(self) -> str | None:
        return self.ending.write_report()
