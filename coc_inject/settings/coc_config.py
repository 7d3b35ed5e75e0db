"""CocConfig: the resolved settings of one process, one field per row of the settings table.

The class is made from the table (so a new setting is one row), frozen and hashable so that it
can key caches; its behaviour (what is switched on, the cross-rank fingerprint, ``describe``)
lives in :class:`CocConfigBehaviour` and reads the rows too.
"""

from __future__ import annotations

import dataclasses

from coc_inject.settings import table
from coc_inject.settings.parsers import AUTO
from coc_inject.settings.rules import k_range_error, linears_on


class CocConfigBehaviour:
    """What CocConfig does beyond holding its fields (see CocConfig)."""

    def __post_init__(self):
        # Built by hand (tests, other modules) as well as by load_config, so normalise and
        # check what would otherwise fail far from its cause. None is fine where it is the default.
        for row in table.FIELDS:
            value = getattr(self, row.field)
            if value is not None or row.default is not None:
                object.__setattr__(self, row.field, row.kind.checked(f"CocConfig.{row.field}", value))
        error = k_range_error(self.k_min, self.k_max)
        if error is not None:
            raise error
        # Not a field (so not compared, hashed or fingerprinted): a lookup table for chunks_for.
        object.__setattr__(self, "_chunks_by_shape", dict(self.customized_coc))

    @property
    def enabled(self) -> bool:
        return not self.disabled and linears_on(self.fused, self.parallel_num, self.customized_coc)

    @property
    def tunes_linears(self) -> bool:
        """Are some linears' chunk counts left to COC_PARALLEL_NUM=auto (globally or in COC_CUSTOMIZED)?"""
        return self.enabled and (AUTO in self._chunks_by_shape.values() or (not self.fused and self.parallel_num == AUTO))

    @property
    def cp_algorithm(self) -> str | None:
        """The context-parallel algorithm for the local attention: COC_CP_ALGO, else "megatron"
        (each layer's cp_comm_type) whenever CoC is on, else None (attention left to Megatron)."""
        if self.disabled:
            return None
        return self.cp_algo if self.cp_algo is not None else "megatron" if self.enabled else None

    @property
    def armed(self) -> bool:
        """Does coc-inject patch anything: the linears (enabled), the attention (cp_algorithm,
        flash_attn) or the TransformerBlocks (multi_copy)?"""
        return self.enabled or self.attention_armed or self.multi_copy_armed or self.moe_armed

    @property
    def moe_armed(self) -> bool:
        """Do MoE layers' all-to-alls run as pieces (1, or auto)?"""
        return self.moe_overlap != "0" and not self.disabled

    @property
    def multi_copy_armed(self) -> bool:
        """Do TransformerBlock calls run as copies (a count >= 2, or auto)?"""
        return self.multi_copy != 1 and not self.disabled

    @property
    def attention_armed(self) -> bool:
        """Is Megatron's local attention patched: context parallelism, or the fused kernel at CP = 1?"""
        return self.cp_algorithm is not None or (self.flash_attn and not self.disabled)

    @property
    def mode(self) -> str:
        """"off" | "chunked" | "fused". Fused wins over the chunk count, as in MindSpeed."""
        if not self.enabled:
            return "off"
        return "fused" if self.fused else "chunked"

    def chunks_for(self, m: int, k: int, n: int) -> int:
        """Chunk count for one matmul shape: its ``customized_coc`` entry, else the global setting.

        -1 means "fused kernel" (this shape's entry, or ``USE_COC_FUSED_KERNEL`` for shapes
        without one: fused wins over ``parallel_num``), 1 means "no CoC for this shape",
        AUTO means "tuned at run time".
        ``disabled`` is not folded in: callers look at ``enabled`` first.
        """
        return self._chunks_by_shape.get((m, k, n), -1 if self.fused else self.parallel_num)

    def _agreed_fields(self) -> dict:
        # The rows' ``agreed``: ALWAYS fields always; the others (alone, or as a group) only when
        # one of them differs from its default, so configurations that leave them alone keep the
        # fingerprint they had before those settings existed.
        agreed, groups = {}, {}
        for row in table.FIELDS:
            if row.agreed == table.ALWAYS:
                agreed[row.field] = getattr(self, row.field)
            elif row.agreed is not None:
                group = row.field if row.agreed == table.WHEN_SET else row.agreed
                groups.setdefault(group, []).append(row)
        for rows in groups.values():
            if any(getattr(self, row.field) != row.default for row in rows):
                agreed.update((row.field, getattr(self, row.field)) for row in rows)
        return agreed

    def agreed_values(self) -> dict:
        """Every agreed setting as a rank shows it, by its variable (its COC_CONFIG key where it has
        none): what a settings mismatch names (pipeline/agreement.py). Defaults included, so that a
        setting left alone on one rank shows its value beside another rank's."""
        return {row.variable or row.file_key or row.field: row.kind.shown(getattr(self, row.field))
                for row in table.FIELDS if row.agreed is not None}

    def fingerprint(self) -> int:
        """A non-negative int < 2**63, equal across processes and machines for equal settings.

        Fits an int64 tensor, so ranks can all-reduce (min/max) it to detect disagreement.
        """
        import hashlib  # lazy: hashlib loads OpenSSL, which the bootstrap should not pay for
        import json

        canonical = json.dumps(["coc-inject-config-v1", self._agreed_fields()], sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(canonical.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "big") & (2**63 - 1)

    def exported_environment(self) -> dict:
        """The variables this config sets for the libraries it drives (the rows' ``exports``, of the
        settings that are on)."""
        return {name: value for row in table.FIELDS if row.exports and getattr(self, row.field)
                for name, value in row.exports}

    def describe(self) -> dict:
        """Plain JSON-able dict for display: the derived ``mode``, ``enabled`` and ``cp_algorithm`` (COC_CP_ALGO
        as it applies: shown once, in place of the raw ``cp_algo``), then every other field in table order."""
        shown = {"mode": self.mode, "enabled": self.enabled, "cp_algorithm": self.cp_algorithm}
        shown.update((row.field, row.kind.shown(getattr(self, row.field))) for row in table.FIELDS
                     if row.field != "cp_algo")
        return shown


CocConfig = dataclasses.make_dataclass(
    "CocConfig",
    [(row.field, object, dataclasses.field(default=row.default, compare=row.compared)) for row in table.FIELDS],
    bases=(CocConfigBehaviour,),
    frozen=True,
    namespace={"__module__": __name__,
               "__doc__": "The resolved CoC settings of one process. Frozen and hashable, so it can key caches."},
)
