"""Which of Megatron's settings each wing runs exactly: an allow-list per wing (docs/settings-allowlist.md).

Every field of megatron-core's ``TransformerConfig`` (its ``ModelParallelConfig`` fields included, and
``MLATransformerConfig``'s) has one row per wing: irrelevant to the wing, supported (any value, or the
values listed), or refused with a reason. ``check.refusal(config, wing)`` is the first thing each wing's
guard asks: a refused value, or a value other than the field's default of a field no row classifies,
sends that layer, call or block to Megatron's own path with the field named.

rows.py              the row and its three verdicts (data, no Megatron import)
common.py            rows every wing shares (pipeline, initialisation, the loop's hooks, inference, ...)
linears.py           the tensor-parallel linears' rows
context_parallel.py  the context-parallel attention's rows
multi_copy.py        multi-copy's rows, and the sequence copies' on top of them
moe.py               the MoE pieces' rows
subclasses.py        a config subclass's own fields (not read by Megatron's layers), what it may not override
check.py             the checker: refusal(config, wing, **context), the tables per wing
matrix.py            the wing x setting matrix of docs/compatibility.md, made from the rows
"""
