"""One stderr logger for the whole package, plus "say it once" helpers.

Log lines start with ``[coc-inject]`` so users can grep a job's stderr for them.
The level comes from ``COC_LOG_LEVEL`` through the config (see :func:`configure`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

logger = logging.getLogger("coc_inject")
_once_keys: set = set()
_once_lock = threading.Lock()


def _rank_tag() -> str:
    rank = os.environ.get("RANK")
    return f" rank {rank}" if rank is not None else ""


def global_rank() -> int:
    """This process's global rank from the launcher's environment (0 without one, or unreadable)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size() -> int:
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def configure(level: str = "info") -> None:
    """Attach the stderr handler once and set the level ("debug" | "info" | "warning" | "error")."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[coc-inject{_rank_tag()}] %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper())


def is_debug() -> bool:
    return logger.isEnabledFor(logging.DEBUG)


def once(key, level: int, message: str) -> bool:
    """Log ``message`` the first time ``key`` is seen in this process; return whether it logged."""
    with _once_lock:
        if key in _once_keys:
            return False
        _once_keys.add(key)
    logger.log(level, message)
    return True


def reset_once() -> None:
    """Forget which messages were said (used by uninstall, so a re-install reports afresh)."""
    with _once_lock:
        _once_keys.clear()


def help_text(doc: str) -> str:
    """A docstring's text as a command's --help prints it: without reST markup (``x``, :func:`x`)."""
    import re

    return re.sub(r":[a-z]+:`([^`]*)`", r"\1", doc).replace("``", "")


# torch warns 'Failed to initialize NumPy: No module named numpy' at import where NumPy is not installed;
# none of coc-inject's commands needs NumPy. The filter as -W / PYTHONWARNINGS spell it (for local ranks).
NUMPY_WARNING_FILTER = "ignore:Failed to initialize NumPy:UserWarning"


def quiet_numpy_warning() -> None:
    """Ignore torch's one warning that NumPy is missing in this process (before torch's import)."""
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
