"""One job's meter: the measured steps, their records resolved and summed, and what is said of them.

A step ends at an optimizer step (``torch.optim``'s global post hook; the inner optimizers of
Megatron's chained optimizer step back to back with no module forward between them: one step).
Steps count from 1. A measured step's records are summed at its end, or, on a device, once its
events have completed (a later step's end; at exit after one synchronisation): never a host sync
on the training's path. Said: the first measured step's line per wing (rank 0; every rank at debug),
a line every ``COC_MEASURE_EVERY`` measured steps, the warnings; kept: the first step, the sum of all
measured steps and a compact row per step for COC_REPORT; written: the trace's steps (trace.py).
"""

from __future__ import annotations

import logging

from coc_inject import log, meter, trial
from coc_inject.measure import advice, attribution, clocks, peers, records
from coc_inject.measure.layers import Layers

PER_STEP_KEPT = 1000  # compact rows in the report; the sums cover every measured step


def in_range(step: int, steps) -> bool:
    return steps is not None and step >= steps[0] and (steps[1] is None or step <= steps[1])


class Exposure:
    def __init__(self, config, rank: int = 0):
        self.config, self.rank = config, rank
        self.layers = Layers(lambda: self.recording)
        self.group_name = attribution.GroupNames()
        self.step = 1
        self._disarmed = False
        self.recording = self._measured(1)
        self._records: list = []
        self._begin = meter.now()
        self._forwards_at_boundary = 0
        self._device_clock = None
        self._pending: list = []  # (step, records, begin, end) waiting for their device events
        self.first = None  # the first measured step's sums
        self.total = None  # every measured step's sums
        self.steady = None  # the sums of the measured steps after the first, without auto's trials
        self.steady_steps: list = []
        self.trial_steps: list = []  # measured steps in which auto's trials ran
        self._trials_at_begin = trial.entered()
        self._finished = False
        self._own = False  # the meter's own collective (peers.py) is in flight
        self._kept_apart: dict = {}  # id(group) -> (group, collectives issued inside auto's trials this step)
        self.not_comparable: list = []  # groups whose members recorded other collectives (peers.py), per step
        self._window: list = []  # the last COC_MEASURE_EVERY steps' sums
        self.per_step: list = []
        self.warnings: list = []
        self.traced: list = []  # paths of the trace files written
        self.trace_warnings: list = []  # why COC_TRACE wrote less than asked (an unwritable directory, too few steps)
        self._step_hook = None

    # -- the hot path -------------------------------------------------------------------------

    def paused(self) -> bool:
        return self._own or trial.active()  # auto's trials, the meter's own reduce: not the job's communication

    def kept_apart(self, group) -> None:
        """A collective issued inside auto's trials: never in the sums, its group compared at the step's end
        all the same (a peer may have issued it outside its trials, peers.py)."""
        if not self._own:
            entry = self._kept_apart.get(id(group))
            self._kept_apart[id(group)] = (group, 1 if entry is None else entry[1] + 1)

    def clock_for(self, device_type: str, record):
        module = clocks.device_module(device_type)
        if module is None:
            return None
        if self._device_clock is None:
            self._device_clock = clocks.DeviceClock(module)
        if self._device_clock.anchor_event is None:
            self._device_clock.anchor()
        return self._device_clock

    def clock_of(self, record):
        return self._device_clock if record.marks is not None else None

    def add(self, record) -> None:
        self._records.append(record)

    def issued_since(self, count: int) -> list:
        """The records of this step from the ``count``-th on (a coalesced batch's, metered.coalescing)."""
        return self._records[count:]

    @property
    def issued(self) -> int:
        return len(self._records)

    # -- steps --------------------------------------------------------------------------------

    def _measured(self, step: int) -> bool:
        if self._disarmed:
            return False
        return in_range(step, self.config.measure) or (self.config.trace_dir is not None
                                                       and in_range(step, self.config.trace_steps))

    def _measured_later(self, step: int) -> bool:
        """Whether ``step`` or a later one is measured or traced."""
        ranges = [self.config.measure] + ([self.config.trace_steps] if self.config.trace_dir is not None else [])
        return not self._disarmed and any(r is not None and (r[1] is None or step <= r[1]) for r in ranges)

    def arm(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.layers.install()
        self._step_hook = register_optimizer_step_post_hook(self._on_optimizer_step)

    def disarm(self) -> None:
        self.recording, self._disarmed = False, True  # a wrapper a module bound meanwhile only calls through
        self.layers.uninstall()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self.layers.forwards == self._forwards_at_boundary:
            return  # another optimizer of the same step (Megatron's chained optimizer)
        self._forwards_at_boundary = self.layers.forwards
        self.end_step()

    def end_step(self) -> None:
        end = meter.now()
        if self.recording:
            if self._device_clock is None:
                self._separate_peers()
            trials = trial.entered() != self._trials_at_begin
            self._pending.append((self.step, self._records, self._begin, end, self._device_clock, trials))
        self._records, self._kept_apart = [], {}
        if self._device_clock is not None:
            self._device_clock = clocks.DeviceClock(self._device_clock.module)  # the next step's anchor
        self.step += 1
        self.recording = self._measured(self.step)
        if not self._measured_later(self.step):  # past every range: the hooks go, the wrappers call through
            self.layers.uninstall()
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None
        self._resolve(wait=False)
        self._begin = meter.now()  # the meter's own work here (sums, names, a trace) is no step's
        self._trials_at_begin = trial.entered()

    def _separate_peers(self) -> None:
        """Host clock: each collective's wait for slower ranks told apart (peers.py), every rank at its step's end."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        self._own = True
        try:
            mismatched = peers.separate(self._records, self._kept_apart)
        finally:
            self._own = False
        for group, (fewest, most), recorded, in_trials in mismatched:
            name = self.group_name(group)
            entry = {"step": self.step, "group": name, "ranks": _ranks(group), "recorded": recorded,
                     "members_recorded": [fewest, most], "in_trials": in_trials}
            self.not_comparable.append(entry)
            log.once(("COC_MEASURE not comparable", name), logging.WARNING,
                     f"COC_MEASURE: step {self.step}, group {name} (ranks {entry['ranks']}): its ranks recorded "
                     f"other collectives ({fewest} to {most}; this rank {recorded}, and {in_trials} inside auto's "
                     "trials, kept apart): not comparable, its waits are not told apart from waiting for slower "
                     "ranks (all exposed)")

    def finish(self) -> None:
        """At exit: the step in progress is not a step; the pending ones are resolved (one sync)."""
        if self._pending and self._pending[-1][4] is not None:
            self._pending[-1][4].module.synchronize()
        self._resolve(wait=True)
        if self._finished:
            return
        self._finished = True
        if self.total is not None:
            self._end_of_run()
        self._traces_missed()

    def _resolve(self, wait: bool) -> None:
        while self._pending:
            step, collectives, begin, end, clock, trials = self._pending[0]
            if clock is not None and not all(r.marks is None or clocks.resolve(r, clock) for r in collectives):
                if not wait:
                    return
                unresolved = sum(r.marks is not None for r in collectives)
                collectives = [r for r in collectives if r.marks is None]
                log.logger.warning("COC_MEASURE: %d collectives of step %d never completed on the device; left out",
                                   unresolved, step)
            self._pending.pop(0)
            self._step_done(step, collectives, begin, end, trials)

    def _step_done(self, step, collectives, begin, end, trials=False) -> None:
        if step == 1 and collectives:  # from the first collective: not the model's construction before it
            begin = min(r.issued for r in collectives)
        summary = records.summarize(collectives, end - begin)
        if self.first is None:  # names while the model is alive: one pass over the live objects, once
            self.layers.names()
        if self.config.trace_dir is not None and in_range(step, self.config.trace_steps):
            from coc_inject.measure import trace

            path = trace.write(self.config.trace_dir, self.rank, step, begin, end, collectives,
                               records.communication_times(collectives), self.layers.names())
            if path is not None:
                self.traced.append(path)
        if not in_range(step, self.config.measure):
            return
        self.total = records.merged([self.total, summary] if self.total is not None else [summary])
        steady = not trials and self.first is not None  # neither the first measured step nor one with trials
        if trials:
            self.trial_steps.append(step)
        elif steady:
            self.steady = records.merged([self.steady, summary] if self.steady is not None else [summary])
            self.steady_steps.append(step)
        if len(self.per_step) < PER_STEP_KEPT:
            self.per_step.append({"step": step, "step_s": summary["step_s"], "total": summary["total"],
                                  "wings": summary["wings"]})
        if self.first is None:
            self.first = dict(summary, step=step)
            self._say(f"step {step}", summary)
        every = self.config.measure_every
        if every and steady:  # a line every COC_MEASURE_EVERY steady steps, naming them
            self._window.append((step, summary))
            if len(self._window) == every:
                steps = [at for at, _ in self._window]
                self._say(f"steady step{'s' if every > 1 else ''} {records.step_runs(steps)}",
                          records.merged([part for _, part in self._window]))
                self._window = []

    def steady_label(self) -> str:
        """The steps the steady figures cover, as the lines and the report name them."""
        steps = self.steady_steps
        return f"steady step{'s' if len(steps) != 1 else ''} {records.step_runs(steps)}" if steps else "no steady step"

    def _traces_missed(self) -> None:
        """COC_TRACE_STEPS past the job's last step: no trace and, until now, no word."""
        if self.config.trace_dir is None or self.traced or self.trace_warnings:
            return
        if self.step - 1 < self.config.trace_steps[0]:  # self.step: the step in progress at exit, never ended
            line = (f"COC_TRACE_STEPS={records.step_range(self.config.trace_steps)}: the job ended after step {self.step - 1}, before "
                    f"the first traced step; no trace was written into {self.config.trace_dir}")
            self.trace_warnings.append(line)
            if log.global_rank() == 0 or log.is_debug():
                log.logger.warning("%s", line)

    def _end_of_run(self) -> None:
        """The end-of-run line on rank 0 and the warnings, judged on the steady steps (the first measured
        step and steps with auto's trials left out; every measured step where none is steady)."""
        left_out = sorted({self.first["step"], *self.trial_steps}) if self.first is not None else []
        if self.steady is not None:
            what, summary = self.steady_label(), self.steady
            what += f", left out: step{'s' if len(left_out) > 1 else ''} {records.step_runs(left_out)}"
        else:
            what, summary = "every measured step (no steady one: the first and steps with trials only)", self.total
        self._say(f"end of run, {what}", summary)
        self.warnings = advice.warnings(self.config, summary, what.split(",")[0])
        if log.global_rank() == 0 or log.is_debug():
            for line in self.warnings:
                log.logger.warning("%s", line)

    def _say(self, what: str, summary: dict) -> None:
        level = logging.INFO if log.global_rank() == 0 else logging.DEBUG
        log.logger.log(level, "%s", advice.line(what, summary))

    # -- the report ---------------------------------------------------------------------------

    def report(self) -> dict:
        names = self.layers.names()
        return {
            "clock": "host" if self._device_clock is None else f"{self._device_clock.module.__name__} events",
            "measured_steps": self.config.measure and list(self.config.measure),
            "first_step": _named(self.first, names),
            "total": _named(self.total, names),
            "steady": _named(self.steady, names),
            "steady_steps": self.steady_steps,
            "trial_steps": self.trial_steps,
            "per_step": self.per_step,
            "warnings": self.warnings,
            "traces": self.traced,
            "trace_warnings": self.trace_warnings,
            "not_comparable": self.not_comparable[:PER_STEP_KEPT],
        }


def _ranks(group) -> list:
    import torch.distributed as dist

    try:
        return list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a stand-in group (tests)
        return []


def _named(summary, names: dict):
    """A summary with its layer keys ``(id, phase, wing)`` written as text: "<layer> | <phase> | <wing>"."""
    if summary is None:
        return None
    layers = {f"{names.get(layer, '(no layer)') if layer is not None else '(no layer)'} | {phase} | {wing}": row
              for (layer, phase, wing), row in summary["layers"].items()}
    return dict(summary, layers=layers)
