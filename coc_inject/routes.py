"""The vocabulary of what coc-inject does with one call: the layer cases and the routes.

A ``LayerCase`` names a tensor-parallel linear call the engine handles (the tuner's keys, the
tune cache, ``bench`` and ``tune`` use the same names). A route is where one call goes: CoC's
chunked pipeline (``Chunked``), a fused kernel (``Fused``), Megatron's own forward (``MegatronPath``), or, for
attention, ``AttentionRoute``; for a TransformerBlock, ``CopiesRoute``; for an MoE layer, ``MoERoute``. The engine plans with them and the coverage counts them as
dict keys, so each is frozen and hashes by what the report shows.

Stdlib only: a dependency of the engine, the coverage and the tuner alike.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import ClassVar


class LayerCase(str, enum.Enum):
    """A layer/mode combination; its value is the name in cache files, reports and printed text."""

    ROW = "row"  # RowParallelLinear: mm + all-reduce
    ROW_SP = "row-sp"  # RowParallelLinear, sequence parallel: mm + reduce-scatter
    COLUMN_SP = "column-sp"  # ColumnParallelLinear, sequence parallel: all-gather + mm
    COLUMN_BWD = "column-bwd"  # ColumnParallelLinear without SP: only its backward all-reduce is chunked

    def __str__(self) -> str:  # the plain name in f-strings and str(), as the literal it replaces
        return self.value

    __format__ = str.__format__

    @classmethod
    def of(cls, row: bool, sequence_parallel: bool) -> LayerCase:
        if row:
            return cls.ROW_SP if sequence_parallel else cls.ROW
        return cls.COLUMN_SP if sequence_parallel else cls.COLUMN_BWD

    @property
    def sequence_parallel(self) -> bool:
        return self in (LayerCase.ROW_SP, LayerCase.COLUMN_SP)


CASE_NAMES = tuple(case.value for case in LayerCase)


class _Interned:
    """One object per value (``Chunked(4) is Chunked(4)``), so the route hashes and compares by
    identity, in C: the linears' routes are counted at every call, and a dataclass's generated
    hash and equality are Python calls. The value is the constructor's arguments, positional."""

    _made: ClassVar[dict]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._made = {}

    def __new__(cls, *value):
        made = cls._made.get(value)
        if made is None:
            made = cls._made[value] = super().__new__(cls)
        return made

    def __reduce__(self):  # pickle and copy rebuild through __new__: the same object again
        return type(self), tuple(getattr(self, f.name) for f in fields(self))


@dataclass(frozen=True, eq=False)
class Chunked(_Interned):
    """CoC's chunked pipeline with ``chunks`` chunks."""

    name: ClassVar[str] = "chunked"
    chunks: int


@dataclass(frozen=True)
class Fused:
    """A fused kernel; counted by the backend's name, ``kernel`` (what the Function runs) rides along."""

    name: ClassVar[str] = "fused"
    backend: str
    kernel: object = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, eq=False)
class MegatronPath(_Interned):
    """Megatron's own forward, and why. ``expected`` ones are logged at debug only."""

    name: ClassVar[str] = "megatron"
    reason: str
    expected: bool = False

    def __new__(cls, reason: str, expected: bool = False):  # the value positional, whichever way it is given
        return super().__new__(cls, reason, expected)


# The start of a MegatronPath's reason when COC_PARALLEL_NUM=auto measured Megatron's own path
# fastest: CoC stepping aside on purpose is not a "CoC did nothing" problem.
AUTO_CHOSE_MEGATRON = "auto chose Megatron's own path"
# Inside multi-copy's copies, COC_PARALLEL_NUM=auto's linears run Megatron's path where the block's
# trials found the copies faster without CoC's chunks (the copies already overlap the collectives);
# COC_MOE_OVERLAP=auto's MoE layers run Megatron's dispatcher where they found them faster without pieces.
COPIES_CHOSE_MEGATRON = "multi-copy: the copies ran faster with Megatron's own linears inside them"
COPIES_CHOSE_DISPATCHER = "multi-copy: the copies ran faster with Megatron's own dispatcher inside them"


@dataclass(frozen=True)
class Inner:
    """What the tuned wings inside a block's copies run: their own choice (True) or Megatron's path."""

    linears: bool = True  # COC_PARALLEL_NUM=auto's linears chunk
    experts: bool = True  # COC_MOE_OVERLAP=auto's MoE layers run as pieces


AS_SET = Inner()
_MEGATRONS = {Inner(False, True): "linears", Inner(True, False): "dispatcher",
              Inner(False, False): "linears and dispatcher"}


def inside(copies: int, inner: Inner = AS_SET):
    """COC_MULTI_COPY's choice of ``copies`` copies with ``inner``: a plain count where every tuned wing
    inside runs as it chose, else a text naming what runs Megatron's path (cacheable, printable)."""
    return copies if inner == AS_SET else f"{copies} copies, Megatron's {_MEGATRONS[inner]}"


def copies_of(choice) -> int:
    """The copy count of a multi-copy choice (a count, or :func:`inside`'s text)."""
    return choice if isinstance(choice, int) else int(choice.split()[0])


def inner_of(choice) -> Inner:
    """What the tuned wings inside a multi-copy choice's copies run (:func:`inside`'s inverse)."""
    if isinstance(choice, int):
        return AS_SET
    megatrons = choice.split("Megatron's ", 1)[1]
    return Inner(linears="linears" not in megatrons, experts="dispatcher" not in megatrons)


# Attention's algorithm when COC_FLASH_ATTN left a call to Megatron's attention.
MEGATRON_ATTENTION = "Megatron's attention"


@dataclass(frozen=True)
class AttentionRoute:
    """An attention call run by coc-inject (context parallelism, or COC_FLASH_ATTN at CP = 1), or a
    COC_FLASH_ATTN call left to Megatron's attention (``algorithm`` MEGATRON_ATTENTION, with a reason)."""

    name: ClassVar[str] = "context-parallel"
    algorithm: str
    cp_size: int
    kernel: str | None = None
    reason: str | None = None

    @property
    def megatron_instead(self) -> bool:
        return self.algorithm == MEGATRON_ATTENTION

    @property
    def fused_at_cp1(self) -> bool:
        return self.cp_size == 1 and not self.megatron_instead


@dataclass(frozen=True)
class CopiesRoute:
    """A TransformerBlock call run as ``copies`` copies (multi-copy parallel), or, with ``copies`` 1,
    Megatron's block and why; copies whose backward runs one after the other say why."""

    name: ClassVar[str] = "multi-copy"
    copies: int
    layers: int
    reason: str | None = None
    backward_in_turn: str | None = None  # copies whose forward marked no cut: why their backward cannot overlap
    split: str | None = None  # with copies: "batch" or "sequence" (what the copies split)


@dataclass(frozen=True)
class MoERoute:
    """An MoE layer call whose dispatcher's all-to-alls ran in ``pieces`` pieces (``chunks`` per local
    expert), or, with ``pieces`` 0, Megatron's dispatcher and why."""

    name: ClassVar[str] = "moe"
    pieces: int
    chunks: int = 0
    reason: str | None = None


# The names the report's "calls" totals use, in their order.
COUNTED = (Chunked, Fused, MegatronPath, AttentionRoute, CopiesRoute, MoERoute)
