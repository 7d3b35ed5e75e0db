"""Resolution: the settings table's values from the environment, the ``COC_CONFIG`` file and
MindSpeed's flags, strongest first, then the defaults; every problem collected in table order.

A flag applies only where its variable is unset, and a flag disagreeing with its variable is an
error, as is a refinement whose switch is off (rules.SWITCHED_ON).
"""

from __future__ import annotations

import os

from coc_inject.settings import table
from coc_inject.settings.argv import MINDSPEED_COC_FLAGS, CP_FLAGS, NO_FLAGS, flags_without_use_ascend_coc, is_given
from coc_inject.settings.coc_config import CocConfig
from coc_inject.settings.parsers import ConfigError, DuplicateKey, loads
from coc_inject.settings.rules import k_range_error, refinement_error


def _env_text(environ, name: str) -> str | None:
    """The variable's text, or None when unset; empty or blank counts as unset."""
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    return text


def _resolve(environ, argv_flags, cp_flags) -> tuple[dict, list]:
    """Every variable parsed in table order; returns (CocConfig kwargs, errors)."""
    errors: list = []
    values: dict = {}
    given: dict = {}  # the variables' texts by field, valid or not
    from_file: dict = {}
    for row in table.SETTINGS:
        if row.variable is None or row.kind is None:
            continue
        text = _env_text(environ, row.variable)
        if row.kind is table.CONFIG_FILE:
            if text is not None:
                values[row.field] = text.strip()
                from_file = _read_config_file(values[row.field], errors)
        elif text is None:
            if row.environ_default is not None:
                values[row.field] = row.environ_default(environ)
        else:
            given[row.field] = text
            try:
                values[row.field] = row.kind.parse(row.variable, text)
            except ConfigError as exc:
                errors.append(exc)
    # Each variable overrides its own key of the file (COC_CUSTOMIZED replaces the whole dict).
    values.update((field, value) for field, value in from_file.items() if field not in given)

    if argv_flags:
        flags = {**NO_FLAGS, **argv_flags}
        refused = flags_without_use_ascend_coc(flags)
        errors.extend(refused)
        if not refused:
            _merge_flags(flags, MINDSPEED_COC_FLAGS, given, values, errors)
    _merge_flags(cp_flags or {}, CP_FLAGS, given, values, errors)
    # After the flags: they may switch on what a refinement needs.
    for row in table.SETTINGS:
        if row.needs is not None and row.field in values:
            flags = (argv_flags if row.flag_needs_use_ascend_coc else cp_flags) or {}
            by_flag = row.field in flags
            error = refinement_error(row.needs, row.flag if by_flag else row.variable, values, row.field,
                                     None if by_flag else given.get(row.field))
            if error is not None:
                errors.append(error)
    return values, errors


def _merge_flags(flags, rows, given, values, errors) -> None:
    """MindSpeed's flags where the matching variable is unset; disagreeing with it is an error."""
    for row in rows:
        value = flags.get(row.field)
        if not is_given(row, value):
            continue
        value = row.kind.flag_value if row.kind.switch else value
        if not row.kind.accepts(value):
            errors.append(ConfigError(row.flag, value, row.env_allowed))
        elif given.get(row.field) is None:
            values[row.field] = value
        elif row.field in values and values[row.field] != value:
            errors.append(_disagreement(row, value, given[row.field].strip()))


def _disagreement(row, value, text: str) -> ConfigError:
    where = f"{row.flag} / {row.variable}"
    if row.kind.switch:
        return ConfigError(where, f"true / {text}", "the same setting in both places, or only one of them",
                           message=(f"{row.flag} disagrees with {row.variable}={text}: "
                                    "drop the flag, or unset the variable"))
    return ConfigError(where, f"{value} / {text}", "the same value in both places, or only one of them",
                       message=(f"{row.flag} {value} disagrees with {row.variable}={text}: "
                                "set only one of them, or the same value in both"))


def _config_file_object(path: str) -> dict:
    """The COC_CONFIG file's JSON object, or a ConfigError saying why there is none."""
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as handle:
            raw = loads(handle.read())
    except OSError as exc:
        reason = f"cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError as exc:
        reason = f"is not UTF-8 text ({exc.reason})"
    except DuplicateKey as dup:
        reason = f"repeats the key {dup.args[0]!r}"
    except ValueError as exc:
        reason = f"is not valid JSON ({exc})"
    else:
        if isinstance(raw, dict):
            return raw
        reason = f"holds a JSON {type(raw).__name__}, not an object"
    raise ConfigError("COC_CONFIG", path, table.CONFIG_FILE.allowed, reason=reason)


def _read_config_file(path: str, errors: list) -> dict:
    """Validated values of the COC_CONFIG file, keyed by CocConfig field; errors are appended."""
    try:
        raw = _config_file_object(path)
    except ConfigError as exc:
        errors.append(exc)
        return {}
    values = {}
    for key, value in raw.items():
        row = table.FILE_KEYS.get(key)
        try:
            if row is None:
                raise ConfigError(f"COC_CONFIG={path}", key, "one of the keys " + ", ".join(table.FILE_KEYS),
                                  reason="has an unknown key")
            value = row.kind.from_json(f"COC_CONFIG={path}: key {key!r}", value)
        except ConfigError as exc:
            errors.append(exc)
            continue
        if row.field is not None:  # a key without a field is validated, then ignored
            values[row.field] = value
    # Checked on the values the config would end up with, so a file k_max below the
    # default k_min is caught too.
    error = k_range_error(values.get("k_min", table.BY_FIELD["k_min"].default),
                          values.get("k_max", table.BY_FIELD["k_max"].default), f"COC_CONFIG={path}")
    if error is not None:
        errors.append(error)
    return values


def validate_all(environ=None, argv_flags: dict | None = None, cp_flags: dict | None = None) -> list:
    """Every problem with the settings, in table order (empty when all is well)."""
    _, errors = _resolve(os.environ if environ is None else environ, argv_flags, cp_flags)
    return errors


def load_config(environ=None, argv_flags: dict | None = None, cp_flags: dict | None = None) -> CocConfig:
    """The CocConfig from ``environ`` (default ``os.environ``) and optional MindSpeed flags
    (``argv_flags``: extract_mindspeed_flags; ``cp_flags``: extract_cp_flags).

    Raises the first :class:`ConfigError`; use :func:`validate_all` to see all of them.
    """
    values, errors = _resolve(os.environ if environ is None else environ, argv_flags, cp_flags)
    if errors:
        raise errors[0]
    return CocConfig(**values)


def unknown_variables(environ=None) -> list:
    """Set ``COC_*`` / ``USE_COC_*`` names that are not ours, e.g. typos like COC_PARALLEL_NUMS.

    Not an error (someone else may own the name); meant for a warning or the CLI status.
    """
    environ = os.environ if environ is None else environ
    known = set(table.KNOWN_VARIABLES)
    return sorted(n for n in environ if n.startswith(("COC_", "USE_COC_")) and n not in known)
