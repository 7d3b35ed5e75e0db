"""Configs that subclass Megatron's: which of their fields Megatron reads, and what a subclass may not change.

Megatron-Bridge's model providers (``GPTModelProvider(TransformerConfig, ModelProviderMixin)``,
src/megatron/bridge/models/gpt_provider.py) and NeMo 2's ``GPTConfig(TransformerConfig, IOMixin)`` add fields
of their own (``seq_length``, ``vocab_size``, ``transformer_layer_spec``, ...) that build the model around
Megatron's layers. Megatron's layers read the fields of Megatron's own config classes; a field only a
subclass declares is not one of them, so it is not read there: classified by construction, never unknown.
Megatron's code does read a few names no config class of it declares, through ``getattr`` / ``hasattr``
(:data:`READ_UNDECLARED`; tests/settings/test_config_subclasses.py scans each release's sources for more):
a subclass that declares one is read, and its row here says what that does to each wing.

Megatron's fields keep Megatron's defaults: a subclass that redeclares one with another default (Bridge:
``masked_softmax_fusion = True``) is checked against Megatron's, so a refused setting is not taken for off.

What Megatron's layers do with a config besides reading fields (megatron-core 0.12 to 0.19, read from the
sources): attribute access (``getattr`` / ``hasattr`` everywhere), writes (``shared_experts.py`` sets
``ffn_hidden_size`` on its copy, ``extensions/transformer_engine.py`` ``tp_comm_overlap``), and the
heterogeneous block asks the config for each layer's (``transformer_block.py``: ``get_config_for_layer``).
A subclass that overrides one of :data:`LAYER_CALLED`, or puts a property (any descriptor) where Megatron has
a field, changes what the layers read: refused, naming it. Not refused: ``__post_init__`` (construction,
before any layer; the rows read the values it leaves) and the copy protocol (``copy.copy`` / ``deepcopy``,
which attention, the experts and the shared experts make of their config; Bridge overrides ``__deepcopy__``
to keep its process groups shared): the copy is the config of the layer built from it, read as any config.
"""

from __future__ import annotations

import dataclasses
import inspect

from coc_inject.allowlist.rows import irrelevant, supported, table

MEGATRON_PACKAGE = ("megatron", "core")

LAYER_CALLED = ("__getattribute__", "__getattr__", "__setattr__", "get_config_for_layer")

ROPE = supported(
    "the rotary embedding a subclass selects: GPTModel reads position_embedding_type from its config in place "
    "of its own argument (0.12 to 0.19 gpt_model.py: hasattr(self.config, 'position_embedding_type')) and the "
    "yarn_* fields for YaRN's rope (0.16+ gpt_model.py, hybrid_model.py); the attention scales the rope's cos "
    "and sin by their concentration factor (0.19 attention.py:326, yarn_rotary_pos_embedding.py:274): the "
    "layers' own math before the core attention, token by token",
    "position_embedding_type", "yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings",
    "yarn_beta_fast", "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "yarn_correction_range_round_to_int")

OUTSIDE_THE_LAYERS = irrelevant(
    "read by Megatron outside every layer a wing runs: the gradient finalisation (finalize_model_grads.py: "
    "has_cond_embedder, flextron), LLaVA's model assembly (llava_model.py), the vision CUDA graphs "
    "(cuda_graphs.py), the optimizer's and DDP's own configs, TensorRT-LLM export",
    "has_cond_embedder", "flextron", "language_model_type", "class_token_len", "max_vision_cuda_graph_seq_length",
    "num_position_embeddings", "spatial_merge_size", "muon_scale_mode", "reshard_after_forward",
    "new_decoder_architecture")

ROWS = table(ROPE, OUTSIDE_THE_LAYERS)

# Every name Megatron reads off a config without declaring it (plus qk_l2_norm, 0.12's modelopt spec, a
# field of later releases with its own row).
READ_UNDECLARED = frozenset(ROWS) | {"qk_l2_norm"}


def _is_megatrons(cls) -> bool:
    return tuple(cls.__module__.split(".")[:2]) == MEGATRON_PACKAGE


def megatron_fields(cls) -> dict | None:
    """name -> dataclass field, as Megatron's own config classes among ``cls``'s bases declare them (None: no
    Megatron class there, e.g. a stand-in)."""
    found = None
    for base in reversed(cls.__mro__):
        if _is_megatrons(base) and dataclasses.is_dataclass(base):
            found = found or {}
            found.update((field.name, field) for field in dataclasses.fields(base))
    return found


def read_by_megatron(name: str, megatron: dict) -> bool:
    """Whether Megatron's code reads field ``name`` of a config whose Megatron fields are ``megatron``."""
    return name in megatron or name in READ_UNDECLARED


def _defined(cls, name: str) -> tuple:
    """``(the class of cls's MRO that defines name, its value)``, or ``(None, None)``; looking through
    coc-inject's own counting ``__setattr__`` (coc_inject.verdicts.watch) to what it wraps: a class whose own
    ``__setattr__`` it replaced still defines that one, and a class it was put on only inherits."""
    mro = cls.__mro__
    for index, owner in enumerate(mro):
        value = vars(owner).get(name)
        if value is None:
            continue
        while getattr(value, "coc_counts_sets", False):
            value = value.__wrapped__
            inherited = next((vars(c)[name] for c in mro[index + 1:] if name in vars(c)), None)
            if value is inherited:
                break
        else:
            return owner, value
    return None, None


def overridden(cls, megatron: dict) -> str | None:
    """What a subclass overrides that Megatron's layers call or read (module docstring), named; or None."""
    found = []
    for name in (*LAYER_CALLED, *megatron):
        owner, value = _defined(cls, name)
        if owner is None or owner is object or _is_megatrons(owner):
            continue
        if name in LAYER_CALLED:
            found.append(f"{owner.__name__}.{name}()")
        elif hasattr(type(value), "__get__") and name not in inspect.get_annotations(owner):
            found.append(f"{owner.__name__}.{name} (a {type(value).__name__} over Megatron's field)")
    return ", ".join(found) or None
