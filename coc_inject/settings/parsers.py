"""Pure value parsers of the settings and their error: each returns a value or raises
:class:`ConfigError`, whose one-line text names the setting, the value and what is allowed.

The kinds (``settings.kinds``) bundle these per kind of value; bench and tune reuse a few of them
for their own command-line options.
"""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
# The chunk count "auto": tuned per shape at run time (coc_inject.tuning). Stored as -2, a
# value no user can type as a count.
AUTO = -2

BOOL_ALLOWED = "1/0, true/false, yes/no, on/off (any case)"
JSON_BOOL_ALLOWED = "JSON true/false or " + BOOL_ALLOWED
POSITIVE_INT_ALLOWED = "an integer >= 1"
PARALLEL_NUM_ALLOWED = f"{POSITIVE_INT_ALLOWED} (1 = off), or auto (tuned per shape at run time)"
SHAPE_KEY_ALLOWED = 'a string "[m, k, n]" holding a JSON list of three integers >= 1'
SHAPE_COUNT_ALLOWED = ('an integer >= 1, -1 (fused for that shape) or "auto" (tuned for that shape); '
                       "1 = off for that shape")
CUSTOMIZED_ALLOWED = (
    'a JSON object {"[m, k, n]": chunks} mapping matmul shapes to chunk counts; '
    f"keys: {SHAPE_KEY_ALLOWED}; values: {SHAPE_COUNT_ALLOWED}"
)
TUNE_CANDIDATES_ALLOWED = "a comma-separated list of distinct integers >= 2 (chunk counts), e.g. 2,4,8"
TUNE_CACHE_ALLOWED = "an absolute file path, or off (no cache)"
TRACE_ALLOWED = "a directory path (made if missing; it must be writable)"
REPORT_ALLOWED = "a file path (its directory must be writable); {rank} is replaced by the global rank"


class ConfigError(ValueError):
    """One invalid setting. ``str()`` is a single line naming the setting, its value and what is allowed.

    ``variable`` names where the value came from: an environment variable
    (``COC_PARALLEL_NUM``), a key in the config file (``COC_CONFIG=/p/x.json: key 'k_min'``)
    or a command-line flag (``--coc-parallel-num``).
    """

    def __init__(self, variable: str, value, allowed: str, *, reason: str = "is invalid", message: str | None = None):
        self.variable = variable
        self.value = value
        self.allowed = allowed
        self.reason = reason
        if message is None:
            message = f"{variable}={value!r} {reason}: expected {allowed}"
        # One line, always: these end up in per-rank log prefixes and CLI tables.
        super().__init__(" ".join(message.splitlines()))

    def __reduce__(self):
        # The default pickling replays ``self.args`` (just the message) into __init__, which
        # would fail; errors raised in worker processes must survive being sent back.
        return (_rebuild_config_error, (self.variable, self.value, self.allowed, self.reason, str(self)))


def _rebuild_config_error(variable, value, allowed, reason, message):
    return ConfigError(variable, value, allowed, reason=reason, message=message)


def is_int(value) -> bool:
    # JSON true/false arrive as bool, which is an int subclass; they are not counts.
    return isinstance(value, int) and not isinstance(value, bool)


def shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def parse_bool(variable: str, text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(variable, text, BOOL_ALLOWED)


def parse_parallel_num(variable: str, text: str) -> int:
    digits = text.strip()
    if digits.lower() == "auto":
        return AUTO
    # isdigit + isascii, not int(): int() also takes "+2", "2_0" and non-ASCII digits.
    if digits.isascii() and digits.isdigit() and int(digits) >= 1:
        return int(digits)
    raise ConfigError(variable, text, PARALLEL_NUM_ALLOWED)


class DuplicateKey(ValueError):
    pass


def _reject_duplicate_keys(pairs):
    # json.loads silently keeps the last of two equal keys; a repeated key is a typo to report.
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen[key] = value
    return seen


def loads(text: str):
    """json.loads that also rejects duplicate keys (DuplicateKey) and NaN/Infinity."""

    import json  # lazy: only needed when COC_CUSTOMIZED or COC_CONFIG is set

    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    return json.loads(text, object_pairs_hook=_reject_duplicate_keys, parse_constant=no_constants)


def is_valid_chunk_count(value) -> bool:
    return is_int(value) and (value >= 1 or value in (-1, AUTO))


def _chunk_count_from_json(value):
    """A customized_coc value as stored: "auto" (any case) becomes AUTO; a typed AUTO stays invalid."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    return None if value == AUTO else value


def parse_customized(variable: str, raw) -> tuple:
    """Turn ``{"[m, k, n]": chunks}`` (JSON text or an already-loaded object) into sorted pairs."""
    loaded = raw
    if isinstance(raw, str):
        try:
            loaded = loads(raw)
        except DuplicateKey as dup:
            raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason=f"repeats the key {dup.args[0]!r}") from None
        except ValueError as exc:
            raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason=f"is not valid JSON ({exc})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(variable, raw, CUSTOMIZED_ALLOWED, reason="is not a JSON object")
    chunks_by_shape = {}
    for key, raw_chunks in loaded.items():
        chunks = _chunk_count_from_json(raw_chunks)
        shape = _parse_shape_key(key)
        if shape is None:
            raise ConfigError(f"{variable} key", key, SHAPE_KEY_ALLOWED)
        if not is_valid_chunk_count(chunks):
            reason = "is a boolean, not an integer" if isinstance(raw_chunks, bool) else "is invalid"
            raise ConfigError(f"{variable}[{key!r}]", raw_chunks, SHAPE_COUNT_ALLOWED, reason=reason)
        if shape in chunks_by_shape:
            # "[1,2,3]" and "[1, 2, 3]" are the same shape spelled twice.
            raise ConfigError(f"{variable} key", key, SHAPE_KEY_ALLOWED + ", each shape at most once",
                              reason=f"repeats the shape {shape_text(shape)}")
        chunks_by_shape[shape] = chunks
    return tuple(sorted(chunks_by_shape.items()))


def _parse_shape_key(key: str):
    try:
        shape = loads(key)
    except ValueError:
        return None
    if isinstance(shape, list) and len(shape) == 3 and all(is_int(d) and d >= 1 for d in shape):
        return tuple(shape)
    return None


def parse_report_path(variable: str, text: str) -> str:
    path = text.strip()
    if not path or "\0" in path:
        raise ConfigError(variable, text, REPORT_ALLOWED)
    # Whether the directory is writable is checked when the report is armed: a bad path is a
    # warning then, never a configuration error that stops the job.
    return path


def parse_trace_dir(variable: str, text: str) -> str:
    path = text.strip()
    if not path or "\0" in path:
        raise ConfigError(variable, text, TRACE_ALLOWED)
    return path  # made and checked writable when the trace is armed: a warning then, the job runs on


def parse_tune_candidates(variable: str, text: str) -> tuple:
    words = [word.strip() for word in text.split(",")]
    if not all(word.isascii() and word.isdigit() and int(word) >= 2 for word in words) or len(set(words)) != len(words):
        raise ConfigError(variable, text, TUNE_CANDIDATES_ALLOWED)
    return tuple(sorted(int(word) for word in words))


def parse_tune_cache(variable: str, text: str) -> str | None:
    path = text.strip()
    if path.lower() == "off":
        return None
    if not os.path.isabs(path) or "\0" in path:
        raise ConfigError(variable, text, TUNE_CACHE_ALLOWED)
    return path


def default_tune_cache(environ) -> str | None:
    """``${XDG_CACHE_HOME:-~/.cache}/coc-inject/tune.json`` (None when no home is known)."""
    base = environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):
        home = environ.get("HOME") or os.path.expanduser("~")
        base = os.path.join(home, ".cache") if os.path.isabs(home) else ""
    return os.path.join(base, "coc-inject", "tune.json") if base else None


def parse_json_bool(where: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return word in TRUE_WORDS
    raise ConfigError(where, value, JSON_BOOL_ALLOWED)
