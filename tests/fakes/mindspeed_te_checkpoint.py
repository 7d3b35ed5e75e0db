"""Stand-in of MindSpeed's ``mindspeed/te/pytorch/module/checkpoint.py`` (26.0.0 and 26.1.0 core_r0.12.1, and
master: one blob, 2eb4145114f9), restated. Its TransformerEngineBasicFeature
(``mindspeed/features_manager/megatron_basic/transformer_engine_basic.py``, ``register_patches``) puts
``transformer_block_forward`` on ``TransformerBlock.forward`` in every job, and
``transformer_block_checkpointed_forward`` on ``TransformerBlock._checkpointed_forward`` unless
``--swap-attention`` or ``--recompute-method block``.

What the two functions do, step by step as MindSpeed's: megatron-core 0.12.1's block forward and its full
recompute, with a per-layer FP8 context inside the recompute's chunks too (the ``use_inner_fp8_context``
argument the block forward passes on). ``mindspeed_patches.te_basic_block_forward`` runs this file's source
in a namespace named as MindSpeed's module (the functions' ``__module__`` and their closures' are
MindSpeed's), never imports it as itself.
"""

from contextlib import nullcontext

import torch


def transformer_block_forward(self, hidden_states, attention_mask, context=None, context_mask=None,
                              rotary_pos_emb=None, rotary_pos_cos=None, rotary_pos_sin=None, attention_bias=None,
                              inference_context=None, packed_seq_params=None, sequence_len_offset=None, *,
                              inference_params=None):
    from megatron.core import tensor_parallel
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_context
    from megatron.core.utils import WrappedTensor, deprecate_inference_params, make_viewless_tensor

    config = self.config
    inference_context = deprecate_inference_params(inference_context, inference_params)
    if isinstance(hidden_states, WrappedTensor):
        hidden_states = hidden_states.unwrap()
    if not self.pre_process:  # a later pipeline stage reads set_input_tensor()'s
        hidden_states = self.input_tensor
    if inference_context and not self.training:
        inference_context.current_batch_size = hidden_states.size(1)
    hidden_states = make_viewless_tensor(inp=hidden_states, requires_grad=True, keep_graph=True)
    rng_context = tensor_parallel.get_cuda_rng_tracker().fork() if config.sequence_parallel else nullcontext()
    # FP8: the delayed recipe around the whole block, any other per layer
    whole_block_fp8 = config.fp8 and config.fp8_recipe == Fp8Recipe.delayed
    per_layer_fp8 = config.fp8 and config.fp8_recipe != Fp8Recipe.delayed
    with rng_context, (get_fp8_context(config) if whole_block_fp8 else nullcontext()):
        if config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(
                hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                packed_seq_params=packed_seq_params, use_inner_fp8_context=per_layer_fp8)
        else:
            for layer in self.layers:
                layer_fp8 = get_fp8_context(config, layer.layer_number - 1) if per_layer_fp8 else nullcontext()
                with self.offload_context, layer_fp8:
                    hidden_states, context = layer(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                        rotary_pos_sin=rotary_pos_sin, attention_bias=attention_bias,
                        inference_context=inference_context, packed_seq_params=packed_seq_params,
                        sequence_len_offset=sequence_len_offset)
                if (torch.is_grad_enabled() and config.cpu_offloading
                        and self.group_prefetch_offload_commit_async is not None):
                    hidden_states = self.group_prefetch_offload_commit_async(hidden_states)
    if self.final_layernorm is not None:
        hidden_states = make_viewless_tensor(inp=self.final_layernorm(hidden_states), requires_grad=True,
                                             keep_graph=True)
    return hidden_states


def transformer_block_checkpointed_forward(self, hidden_states, attention_mask, context, context_mask, rotary_pos_emb,
                                           attention_bias, packed_seq_params, use_inner_fp8_context):
    from megatron.core import tensor_parallel
    from megatron.core.fp8_utils import get_fp8_context

    config = self.config

    def custom(start, end):
        def custom_forward(hidden_states, attention_mask, context, context_mask, rotary_pos_emb):
            for index in range(start, end):
                layer = self._get_layer(index)
                layer_fp8 = get_fp8_context(config, layer.layer_number - 1) if use_inner_fp8_context else nullcontext()
                with layer_fp8:
                    hidden_states, context = layer(
                        hidden_states=hidden_states, attention_mask=attention_mask, context=context,
                        context_mask=context_mask, rotary_pos_emb=rotary_pos_emb, attention_bias=attention_bias,
                        inference_context=None, packed_seq_params=packed_seq_params)
            return hidden_states, context

        return custom_forward

    def checkpointed(function):
        # MindSpeed's FP8 branch (te_checkpoint) calls the same tensor_parallel.checkpoint with these arguments
        return tensor_parallel.checkpoint(function, config.distribute_saved_activations, hidden_states,
                                          attention_mask, context, context_mask, rotary_pos_emb)

    if config.recompute_method == "uniform":  # chunks of recompute_num_layers layers, each checkpointed
        for start in range(0, self.num_layers_per_pipeline_rank, config.recompute_num_layers):
            hidden_states, context = checkpointed(custom(start, start + config.recompute_num_layers))
    elif config.recompute_method == "block":  # the first recompute_num_layers layers checkpointed, one at a time
        skipped = 0
        for index in range(self.num_layers_per_pipeline_rank):
            if config.fp8 and not hidden_states.requires_grad:
                skipped += 1
            if skipped <= index < config.recompute_num_layers + skipped:
                hidden_states, context = checkpointed(custom(index, index + 1))
            else:
                hidden_states, context = custom(index, index + 1)(hidden_states, attention_mask, context,
                                                                  context_mask, rotary_pos_emb)
    else:
        raise ValueError("Invalid activation recompute method.")
    return hidden_states
