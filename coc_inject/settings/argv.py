"""MindSpeed's command-line flags, taken out of ``argv`` so that plain Megatron's argparse runs unchanged.

One scanner (:func:`take_flags`) serves both groups of flags the table names: the CoC flags,
which MindSpeed honours only with ``--use-ascend-coc``, and the context-parallel ones. A flag of a
switch setting takes no value; any other takes ``--flag V`` or ``--flag=V``. Everything after a
bare ``--`` is left alone, and so is a value-less flag written ``--flag=V``.
"""

from __future__ import annotations

from coc_inject.settings import table
from coc_inject.settings.parsers import ConfigError

USE_ASCEND_COC = "--use-ascend-coc"
# Accepted and removed: coc-inject's ring always overlaps its transfers with compute.
CP_OVERLAP_FLAG = "--use-cp-send-recv-overlap"
FLAG_NEEDS_USE_ASCEND_COC = "--use-ascend-coc alongside it (MindSpeed only honours the CoC flags with --use-ascend-coc)"

MINDSPEED_COC_FLAGS = tuple(row for row in table.FLAGS if row.flag_needs_use_ascend_coc)
CP_FLAGS = tuple(row for row in table.FLAGS if not row.flag_needs_use_ascend_coc)
# extract_mindspeed_flags' answer when none is given: a switch is False, a value None.
NO_FLAGS = {"use_ascend_coc": False, **{row.field: False if row.kind.switch else None for row in MINDSPEED_COC_FLAGS}}


def take_flags(argv: list, rows, switches: dict) -> tuple:
    """Take the flags of ``rows`` (and the value-less ``switches``: flag -> key, or None to drop
    it) out of ``argv``: returns (given values by CocConfig field or switch key, the rest)."""
    valued = {row.flag: row for row in rows if not row.kind.switch}
    switches = {**switches, **{row.flag: row.field for row in rows if row.kind.switch}}
    given: dict = {}
    rest: list = []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            rest.extend(argv[index - 1:])
            break
        name, has_value, text = token.partition("=") if isinstance(token, str) else (token, "", "")
        if name in switches and not has_value:
            if switches[name] is not None:
                given[switches[name]] = True
            continue
        row = valued.get(name)
        if row is None:
            rest.append(token)
            continue
        if not has_value:
            if index >= len(argv):
                raise ConfigError(name, None, row.env_allowed,
                                  message=f"{name} is missing its value: expected {row.env_allowed}")
            text = argv[index]
            index += 1
        value = row.kind.parse(name, text)
        if row.field in given and given[row.field] != value:
            # argparse would silently keep the last one; two different values is a mistake.
            raise ConfigError(name, text, f"one value (it was already given as {given[row.field]})",
                              reason="is given twice")
        given[row.field] = value
    return given, rest


def flags_without_use_ascend_coc(flags: dict) -> list:
    """The errors for CoC flags given without --use-ascend-coc (MindSpeed would ignore them)."""
    if flags.get("use_ascend_coc"):
        return []
    return [ConfigError(row.flag, True if row.kind.switch else flags[row.field], FLAG_NEEDS_USE_ASCEND_COC,
                        reason=f"is given without {USE_ASCEND_COC}")
            for row in MINDSPEED_COC_FLAGS if is_given(row, flags.get(row.field))]


def is_given(row, value) -> bool:
    """Does a flags dict hold ``row``'s flag: a switch when true, a valued flag when not None?"""
    return bool(value) if row.kind.switch else value is not None


def extract_mindspeed_flags(argv: list) -> tuple:
    """Take MindSpeed's CoC flags out of ``argv``: returns (flags, argv without them).

    Recognises ``--use-ascend-coc``, ``--coc-parallel-num N`` / ``--coc-parallel-num=N``
    and ``--coc-fused-kernel``; every other token, and everything after a bare ``--``, is
    left exactly as it was. Removing them lets plain Megatron's argparse run unchanged.
    """
    given, rest = take_flags(argv, MINDSPEED_COC_FLAGS, {USE_ASCEND_COC: "use_ascend_coc"})
    flags = {**NO_FLAGS, **given}
    errors = flags_without_use_ascend_coc(flags)
    if errors:
        raise errors[0]
    return flags, rest


def extract_cp_flags(argv: list) -> tuple:
    """Take MindSpeed's context-parallel flags out of ``argv``: (given flags by CocConfig field, the rest).

    ``--context-parallel-algo``, ``--cp-window-size``, ``--ulysses-degree-in-cp`` and
    ``--attention-mask-type`` take a value (``--flag V`` or ``--flag=V``); MoE's ``--moe-alltoall-overlap-comm``
    takes none (it means COC_MOE_OVERLAP=1); ``--use-cp-send-recv-overlap`` is accepted and dropped.
    Everything after a bare ``--`` is left alone.
    """
    return take_flags(argv, CP_FLAGS, {CP_OVERLAP_FLAG: None})
