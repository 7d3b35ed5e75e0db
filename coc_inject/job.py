"""This process's settings, loaded by whichever Megatron import hook fires first.

The hooks (linears, attention, parallel state) share one configuration: MindSpeed's flags are
taken out of ``sys.argv`` once, by the first hook, before Megatron's own argument parser runs;
the configuration is re-read when the ``COC_*`` environment changes (tests, tools that
re-install in one process).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from coc_inject import log

_flags = None  # (MindSpeed CoC flags, MindSpeed CP flags) taken out of sys.argv
_loaded = None  # (environment key, CocConfig)


def _environment_key() -> tuple:
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(("COC_", "USE_COC_"))))


def config():
    """The job's CocConfig; a ConfigError is written to stderr and raised (it stops the import)."""
    global _flags, _loaded
    from coc_inject.config import ConfigError, extract_cp_flags, extract_mindspeed_flags, load_config

    key = _environment_key()
    if _loaded is not None and _loaded[0] == key:
        return _loaded[1]
    try:
        flags, remaining = _flags, None
        if flags is None:
            if importlib.util.find_spec("mindspeed") is not None:  # MindSpeed owns its flags
                flags, remaining = (None, None), list(sys.argv)
            else:
                coc_flags, remaining = extract_mindspeed_flags(list(sys.argv))
                cp_flags, remaining = extract_cp_flags(remaining)
                flags = (coc_flags, cp_flags)
        loaded = load_config(argv_flags=flags[0], cp_flags=flags[1])
    except ConfigError as error:
        sys.stderr.write(f"[coc-inject] configuration error: {error}\n")
        raise
    if remaining is not None:
        sys.argv[:] = remaining
        _flags = flags
    log.configure(loaded.log_level)
    _loaded = (key, loaded)
    return loaded


def forget() -> None:
    """Back to before the first hook (tests)."""
    global _flags, _loaded
    _flags = _loaded = None
