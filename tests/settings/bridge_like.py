"""Configs shaped as Megatron-Bridge's model providers: a dataclass subclass of Megatron's TransformerConfig
adding fields of its own, as ``GPTModelProvider(TransformerConfig, ModelProviderMixin)`` does
(NVIDIA-NeMo/Megatron-Bridge, src/megatron/bridge/models/gpt_provider.py: seq_length, vocab_size,
transformer_layer_spec, position_embedding_type, ... ; redeclared Megatron fields with Bridge's defaults,
masked_softmax_fusion = True) over Bridge's TransformerConfig wrapper (src/megatron/bridge/models/
transformer_config.py: a ``__deepcopy__`` that keeps its process groups shared). NeMo 2's ``GPTConfig``
(nemo/collections/llm/gpt/model/base.py) is the same shape. Restated for the tests, not imported: neither
package is installed here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Optional, Union

from megatron.core.transformer.transformer_config import TransformerConfig


def local_layer_spec(config):
    """Bridge's transformer_layer_spec is a callable of the provider (here: Megatron's local spec)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(num_experts=config.num_moe_experts)


@dataclasses.dataclass
class GPTProviderLike(TransformerConfig):
    _NO_COPY_KEYS = {"_pg_collection"}

    fp16_lm_cross_entropy: bool = False
    parallel_output: bool = True
    share_embeddings_and_output_weights: bool = True
    make_vocab_size_divisible_by: int = 128
    position_embedding_type: str = "learned_absolute"
    seq_length: int = 1024
    scatter_embedding_sequence_parallel: bool = True
    use_transformer_engine_full_layer_spec: bool = False
    transformer_layer_spec: Union[Any, Callable] = local_layer_spec
    generation_config: Optional[Any] = None
    vocab_size: Optional[int] = None
    should_pad_vocab: bool = False
    mtp_enabled: bool = False
    restore_modelopt_state: bool = False
    masked_softmax_fusion: bool = True  # Megatron's field, Bridge's default

    def provide(self, pre_process=None, post_process=None, vp_stage=None):
        """Bridge builds the model from the provider (never called by Megatron's layers)."""
        raise NotImplementedError

    def __deepcopy__(self, memo):  # as Bridge's TransformerConfig: every attribute deep-copied but its groups
        result = type(self).__new__(type(self))
        memo[id(self)] = result
        for key, value in self.__dict__.items():
            setattr(result, key, value if key in self._NO_COPY_KEYS else copy.deepcopy(value, memo))
        return result


# What a provider sets off its defaults (a Bridge Llama-like recipe): every one of them a subclass field or a
# name Megatron reads off it (position_embedding_type, yarn_*: coc_inject/allowlist/subclasses.py).
PROVIDER_SETTINGS = dict(seq_length=16, vocab_size=64, make_vocab_size_divisible_by=64, should_pad_vocab=True,
                         share_embeddings_and_output_weights=False, generation_config={"top_k": 1},
                         use_transformer_engine_full_layer_spec=False, restore_modelopt_state=False)


@dataclasses.dataclass
class PerLayerProvider(GPTProviderLike):
    """Overrides what Megatron's block calls on its config (transformer_block.py: get_config_for_layer)."""

    def get_config_for_layer(self, layer_number: int):
        return self


@dataclasses.dataclass
class PropertyProvider(GPTProviderLike):
    """A property where Megatron has a field: every read computes it."""

    @property
    def hidden_dropout(self) -> float:
        return 0.0

    @hidden_dropout.setter
    def hidden_dropout(self, value) -> None:
        pass


@dataclasses.dataclass
class RedeclaredDefault(GPTProviderLike):
    """Redeclares a Megatron field some wings refuse (no values allowed) with another default."""

    cpu_offloading: bool = True
