"""One part's training step in the lab: a TransformerBlock of Megatron's local spec at one rank's
shapes (this rank's input rows), forward, a loss, backward and an SGD update, timed; a wing's
settings installed before the block is built (the attention wing patches the layer's constructor)
and undone after. Off and on start from the same weights and input, so their losses must agree."""

from __future__ import annotations

import statistics
import time

import torch

from coc_inject.lab.shapes import Part
from coc_inject.settings.parsers import AUTO

LEARNING_RATE = 1e-3


FIXED = {"linears": {"parallel_num": 2}, "context_parallel": {"cp_algo": "ring"}, "multi_copy": {"multi_copy": 2},
         "moe": {"moe_overlap": "1"}}
AUTOS = {"linears": {"parallel_num": AUTO}, "context_parallel": {"cp_algo": "ring"}, "multi_copy": {"multi_copy": AUTO},
         "moe": {"moe_overlap": "auto"}}


def variants(part: Part, fixed: bool = False) -> dict:
    """{wing: CocConfig settings on} for each of the part's wings and all of them, and "off". Where the
    part has CP, Megatron's local attention has no CP path: "off" is the wing's all-gather (the
    baseline), "on" the ring (the lab's outputs make Ulysses' head split a different function). ``fixed``: each
    wing forced on (2 chunks, 2 copies, the MoE pieces) instead of ``auto`` (which may keep Megatron's path)."""
    base = {"cp_algo": "allgather"} if part.cp > 1 else {}
    on = FIXED if fixed else AUTOS
    chosen = {wing: {**base, **on[wing]} for wing in part.wings}
    if len(part.wings) > 1:
        chosen["all"] = {**base, **{k: v for wing in part.wings for k, v in on[wing].items()}}
    return {"off": base, **chosen}


def _install(config):
    from megatron.core.transformer import dot_product_attention, transformer_block
    from megatron.core.transformer.moe import moe_layer

    from coc_inject.context_parallel import install as attention
    from coc_inject.linears import install as linears
    from coc_inject.moe import install as moe
    from coc_inject.multi_copy import install as copies

    if config.enabled:
        linears.install(config)
    if config.attention_armed:
        attention._install(__import__("coc_inject.job", fromlist=["job"]).installation(config), dot_product_attention)
    if config.moe_armed:
        moe.install(config, moe_layer)
    if config.multi_copy_armed:
        copies.install(config, transformer_block)


def build(part: Part, device, dtype):
    """The block and this rank's input, seeded: the same weights for every variant."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coc_inject.testbed.cpu import CpuLayerNorm
    from coc_inject.testbed.models import fresh_rng_tracker

    torch.manual_seed(1234)
    on_cpu = torch.device(device).type == "cpu"
    if on_cpu:
        fresh_rng_tracker()
    else:
        from megatron.core.tensor_parallel import random as tp_random

        tp_random.model_parallel_cuda_manual_seed(1234)
    moe = dict(num_moe_experts=part.experts, moe_router_topk=part.topk, moe_token_dispatcher_type="alltoall",
               expert_model_parallel_size=part.ep, expert_tensor_parallel_size=1, moe_ffn_hidden_size=part.ffn,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.01, add_bias_linear=False,
               ) if part.experts else {}
    config = TransformerConfig(
        num_layers=part.layers, hidden_size=part.hidden, num_attention_heads=part.heads, num_query_groups=part.groups,
        ffn_hidden_size=part.ffn, tensor_model_parallel_size=part.tp, context_parallel_size=part.cp,
        sequence_parallel=part.tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=on_cpu, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0, **moe)
    spec = get_gpt_layer_local_spec(num_experts=part.experts or None, moe_grouped_gemm=False)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec] * part.layers,
                                                                layer_norm=CpuLayerNorm)).to(device)
    if part.experts:  # every EP rank's experts differ, as on a cluster
        rank = parallel_state.get_expert_model_parallel_rank()
        with torch.no_grad():
            for name, param in block.named_parameters():
                if ".local_experts." in name:
                    param.mul_(1.0 + 0.5 * rank)
    rows = part.seq // (part.cp * (part.tp if part.tp > 1 else 1))
    generator = torch.Generator().manual_seed(4321)
    hidden = torch.randn(rows, part.batch, part.hidden, generator=generator).to(device=device, dtype=dtype)
    return block, hidden


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run(part: Part, settings: dict, state, device, dtype, steps: int, warmup: int, on_done=None) -> dict:
    """``steps`` timed steps after ``warmup`` (an ``auto``'s trials run there): median ms, losses, the
    link's modelled seconds a step (M) and, on CUDA, peak memory; ``on_done()`` is called before the
    wing is undone (what its tuners decided is read there)."""
    from coc_inject import job
    from coc_inject.config import CocConfig

    config = CocConfig(**settings)
    _install(config)
    try:
        block, hidden = build(part, device, dtype)
        params = [p for p in block.parameters() if p.requires_grad]
        times, losses, comm, counted = [], [], [], []
        if torch.device(device).type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for step in range(warmup + steps):
            _sync(device)
            before, issued, began = state.comm_seconds, state.collectives, time.perf_counter()
            out = block(hidden.clone().requires_grad_(True), attention_mask=None)
            loss = out.float().square().mean()
            loss.backward()
            with torch.no_grad():
                for param in params:
                    if param.grad is not None:
                        param.sub_(LEARNING_RATE * param.grad)
                        param.grad = None
            _sync(device)
            if step >= warmup:
                times.append(time.perf_counter() - began)
                comm.append(state.comm_seconds - before)
                counted.append(state.collectives - issued)
            losses.append(loss.item())
        if on_done is not None:
            on_done()
        peak = torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None
        return {"ms": statistics.median(times) * 1e3, "losses": losses, "comm_ms": statistics.median(comm) * 1e3,
                "collectives": max(counted),
                "peak_bytes": peak}
    finally:
        job.uninstall()
