"""When the coverage speaks: at the first training step, and at the end of the process.

* the **first-step summary**: one line on global rank 0 (every rank at debug level) when the
  first ``torch.optim.Optimizer.step()`` of the process ends (a global optimizer step hook,
  a no-op once it fired, removed at disarm), with the warnings; a process that never steps an optimizer
  (inference) gets it at exit, unless it ends by an exception or SIGTERM before any patched
  layer call (then there is nothing to summarise; the report's ``ended_by`` says so);
* the **report file** (``COC_REPORT``), written at exit, after an uncaught exception and on
  SIGTERM (torchrun stops the other ranks of a failed job that way).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import sys
import threading

from coc_inject import log
from coc_inject.coverage import reporting


class ProcessEnd:
    """The step hook, the atexit handler and the SIGTERM handler of one coverage."""

    def __init__(self, coverage):
        self.coverage = coverage
        self.summarized = False
        self.ended_by = None  # "exception" or "SIGTERM" when the process did not end normally (report time)
        self._lock = threading.Lock()
        self._step_hook = None
        self._report_written = False
        self._report_enabled = False  # set by arm() once the report directory is known writable
        self._previous_sigterm = None

    def arm(self) -> None:
        """Summarise at the first optimizer step; write the report at exit (if COC_REPORT)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._step_hook = register_optimizer_step_post_hook(self._on_optimizer_step)
        template = self.coverage.config.report
        path = report_path(template)
        if path is None:
            return
        directory = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(directory) and os.access(directory, os.W_OK)):
            log.logger.warning("COC_REPORT=%s: directory %s does not exist or is not writable; no CoC report "
                               "will be written (the job runs on)", template, directory)
            return
        self._report_enabled = True
        atexit.register(self.write_report)
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGTERM)
            if previous in (signal.SIG_DFL, None):
                self._previous_sigterm = signal.SIG_DFL
                signal.signal(signal.SIGTERM, self._on_sigterm)

    def disarm(self) -> None:
        """Undo arm() (uninstall)."""
        self._remove_step_hook()
        atexit.unregister(self.write_report)
        if self._previous_sigterm is not None and signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm)
        self._previous_sigterm = None

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        self.first_step_done()

    def first_step_done(self) -> None:
        with self._lock:
            if self.summarized:
                return
            self.summarized = True
        # The hook stays (a no-op from now on) until disarm(): removing it while torch iterates over the
        # global step hooks would break that iteration for any hook after it (COC_MEASURE's, a user's).
        coverage = self.coverage
        coverage.inspect_model()
        rank = log.global_rank()
        log.logger.log(logging.INFO if rank == 0 else logging.DEBUG, reporting.summary_line(coverage))
        if rank == 0 or log.is_debug():
            for line in reporting.warnings(coverage):
                log.logger.warning(line)

    def ended_before_any_call(self) -> bool:
        """Did the process end abnormally before its first step and before any patched layer call?
        Then a summary would only print "0 of 0 ... none" and a no-call warning after the traceback,
        as if CoC had failed: it is left out (the report says ``ended_by``)."""
        return self.ended_by is not None and not self.summarized and not self.coverage.any_call()

    def _on_sigterm(self, signum, frame):
        self.ended_by = "SIGTERM"
        self.write_report()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def write_report(self) -> str | None:
        """Write the report once (at exit); a failure is one warning, never an exception."""
        path = report_path(self.coverage.config.report)
        if path is None or not self._report_enabled or self._report_written:
            return None
        self._report_written = True
        try:
            if self.ended_by is None and _ended_by_exception():
                self.ended_by = "exception"
            if not self.summarized and not self.ended_before_any_call():
                self.first_step_done()  # no optimizer step: summarise what happened
            self.coverage.inspect_model(walk=True)  # at exit: the heap's picture, half-built modules too
            text = json.dumps(reporting.report(self.coverage), indent=1, default=str) + "\n"
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
    rank = log.global_rank() if rank is None else rank
    if "{rank}" in template:
        return template.replace("{rank}", str(rank))
    return template if rank == 0 else None


def _ended_by_exception() -> bool:
    """At exit: did an uncaught exception end the process? (Python keeps it in sys.last_value /
    sys.last_exc once it has printed the traceback, before the atexit handlers run.)"""
    return getattr(sys, "last_exc", None) is not None or getattr(sys, "last_value", None) is not None
