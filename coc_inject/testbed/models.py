"""The megatron-core layers that the bench, the self-test and tune measure and check on: one
tensor-parallel linear per layer case (:data:`LINEARS`, :func:`build_linear`), a TransformerBlock
(:func:`build_block`) and an MoE layer (:func:`build_moe_layer`). Megatron is imported when a layer
is built (the commands' ``--help`` and argument errors come without it)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from coc_inject.routes import LayerCase
from coc_inject.testbed.cpu import CpuLayerNorm, cpu_moe_shims, cpu_recompute_rng


@dataclass(frozen=True)
class LinearCase:
    name: str
    kind: str  # "row" | "column"
    sequence_parallel: bool
    label: str
    collective: str  # the forward collective, measured alone for M


LINEARS = {case.name: case for case in (
    LinearCase(LayerCase.ROW, "row", False, "Row mm+AR", "all_reduce"),
    LinearCase(LayerCase.ROW_SP, "row", True, "Row SP mm+RS", "reduce_scatter"),
    LinearCase(LayerCase.COLUMN_SP, "column", True, "Column SP AG+mm", "all_gather"),
    LinearCase(LayerCase.COLUMN_BWD, "column", False, "Column dgrad+AR (bwd)", "none"))}


def build_linear(case: LinearCase, m: int, k: int, n: int, dtype, device, batch: int = 1):
    """Layer whose forward matmul is [m, k] x [k, n] on each rank (k, n: per-rank sizes), and its
    input ``[m / batch, batch, k]`` (Column SP: this rank's shard). [m, k, n] is the shape the
    engine keys ``customized_coc`` and ``auto`` decisions by."""
    from megatron.core import parallel_state  # Megatron: not imported by --help and argument errors
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = ModelParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=case.sequence_parallel,
                                 use_cpu_initialization=True, params_dtype=dtype, gradient_accumulation_fusion=False)
    init = torch.nn.init.xavier_normal_
    if case.kind == "row":
        layer = RowParallelLinear(k * tp, n, config=config, init_method=init, bias=False, input_is_parallel=True,
                                  skip_bias_add=True)
        rows = m
    else:
        layer = ColumnParallelLinear(k, n * tp, config=config, init_method=init, bias=False)
        rows = m // tp if case.sequence_parallel else m
    return layer.to(device), torch.randn(rows // batch, batch, k, dtype=dtype, device=device)


def fresh_rng_tracker() -> None:
    """Megatron's RNG tracker made anew (the inference tracker, CPU-safe): ``force_reset`` where the
    release takes it (0.13+); 0.12's initialize_rng_tracker returns early once initialized, so its
    flag is cleared first."""
    import inspect

    from megatron.core.tensor_parallel import random as tp_random

    if "force_reset" in inspect.signature(tp_random.initialize_rng_tracker).parameters:
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    else:
        tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = False
        tp_random.initialize_rng_tracker(inference_rng_tracker=True)


def build_block(args, micro_batch: int | None = None, shims: bool = True):
    """A TransformerBlock of ``args.layers`` GPT layers (local spec, CpuLayerNorm), TP = the world with sequence
    parallelism, and its input (this rank's rows of ``micro_batch`` sequences, default ``args.batch``) and causal
    mask, on the CPU; ``args.recompute``: every layer fully recomputed (uniform, one layer a chunk). A micro-batch
    the copies do not divide (1) runs as sequence copies (:func:`copies_ran` says which split ran). ``args.moe``:
    every layer's MLP an MoE layer (:func:`moe_settings`, its aux-loss coefficient ``args.moe_aux_coeff`` if set;
    Megatron's expert parallelism as initialized)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock, TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(1234)
    fresh_rng_tracker()
    tp = torch.distributed.get_world_size()
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads, ffn_hidden_size=args.ffn,
        tensor_model_parallel_size=tp, sequence_parallel=True, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        **(moe_settings(shims, getattr(args, "moe_aux_coeff", MOE_AUX_COEFF)) if getattr(args, "moe", False) else {}),
        **({"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
           if getattr(args, "recompute", False) else {}))
    if getattr(args, "recompute", False):
        cpu_recompute_rng()
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block = TransformerBlock(config, TransformerBlockSubmodules(layer_specs=[spec] * args.layers,
                                                                layer_norm=CpuLayerNorm))
    if config.num_moe_experts:  # every EP rank's experts differ: a token sent to a wrong one shows
        rank = parallel_state.get_expert_model_parallel_rank()
        with torch.no_grad():
            for param in [p for name, p in block.named_parameters() if ".local_experts." in name]:
                param.mul_(1.0 + 0.5 * rank)
    hidden = torch.randn(args.seq // tp, args.batch if micro_batch is None else micro_batch, args.hidden)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool), diagonal=1)
    return block, hidden, mask


def block_step(block, hidden, mask):
    """One forward + backward of ``block`` (output gradient ones), a fresh leaf input each call."""
    def step():
        out = block(hidden.clone().requires_grad_(True), mask)
        out.backward(torch.ones_like(out))
    return step


def variant_config(args, coc: bool, copies: bool, tune_cache):
    """A bench variant's CocConfig: ``coc``: CoC's linears at ``args.chunks`` (and with ``args.moe`` the MoE
    pieces, auto); ``copies``: ``args.copies`` copies."""
    from coc_inject.config import CocConfig

    return CocConfig(parallel_num=args.chunks if coc else 1, multi_copy=args.copies if copies else 1,
                     moe_overlap="auto" if coc and getattr(args, "moe", False) else "0", tune_cache=tune_cache)


MOE_LOCAL_EXPERTS, MOE_TOPK, MOE_AUX_COEFF = 2, 2, 0.01


def moe_settings(shims: bool = True, aux_coeff: float = MOE_AUX_COEFF) -> dict:
    """The block's MoE MLP: alltoall dispatcher, SequentialMLP experts (the local spec), ``MOE_LOCAL_EXPERTS``
    a rank at Megatron's EP, expert TP as initialized, top-``MOE_TOPK``, Megatron's default routing loss
    (the batch ``aux_loss``); ``shims``: on CPU ranks, with :func:`coc_inject.testbed.cpu.cpu_moe_shims`."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    if shims:
        cpu_moe_shims()
    if not hasattr(moe_utils, "te_general_gemm"):  # 0.13-0.16's router reads it, defined only when TE imports
        moe_utils.te_general_gemm = None
    ep = parallel_state.get_expert_model_parallel_world_size()
    return dict(num_moe_experts=MOE_LOCAL_EXPERTS * ep, moe_router_topk=MOE_TOPK, moe_token_dispatcher_type="alltoall",
                expert_model_parallel_size=ep,
                expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=aux_coeff, add_bias_linear=False)


def copies_ran(block) -> str:
    """How ``block``'s last call ran under multi-copy: "2 copies, sequence split" (or batch; ", through N MoE
    layers" where it has them), or "no copies: why"."""
    from coc_inject.multi_copy.forward import last_route
    from coc_inject.multi_copy.moe import moe_layers

    route, moe = last_route(block), len(moe_layers(block))
    if route is None:
        return "no copies: no block call counted"
    through = f", through {moe} MoE layer{'s' * (moe > 1)}" if moe else ""
    return f"{route.copies} copies, {route.split} split{through}" if route.copies > 1 else f"no copies: {route.reason}"


def install_every_wing(config):
    """Every wing ``config`` arms, into one fresh installation on the imported Megatron modules (as the import
    hooks do; context parallelism first: its install() starts the installation afresh); that installation."""
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention, transformer_block
    from megatron.core.transformer.moe import moe_layer

    from coc_inject import job
    from coc_inject.context_parallel import install as cp_install
    from coc_inject.linears import install as linears
    from coc_inject.moe import install as moe
    from coc_inject.multi_copy import install as copies

    job.uninstall()
    if config.cp_algorithm:
        cp_install.install(config, dot_product_attention, parallel_state)
    if config.enabled:
        linears.install(config)
    if config.moe_armed:
        moe.install(config, moe_layer)
    if config.multi_copy_armed:
        copies.install(config, transformer_block)
    return job.installation(config)


@contextmanager
def block_variant(block, config, compute_only: bool = False, ran: dict | None = None):
    """``config``'s CoC linears, MoE pieces and multi-copy installed on Megatron's modules (every collective a
    no-op with ``compute_only``: the compute-only twin), undone on leaving; with copies armed, ``ran["copies"]``
    says how the block's last call ran (:func:`copies_ran`)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import moe_layer

    from coc_inject import job
    from coc_inject.linears import install as linears
    from coc_inject.moe import install as moe
    from coc_inject.multi_copy import install as copies
    from coc_inject.testbed import link

    if config.enabled:
        linears.install(config)
    if config.moe_armed:
        moe.install(config, moe_layer)
    if config.multi_copy_armed:
        copies.install(config, transformer_block)
    try:
        with link.no_collectives() if compute_only else nullcontext():
            yield
        if config.multi_copy_armed and ran is not None:
            ran["copies"] = copies_ran(block)
    finally:
        job.uninstall()


def build_moe_layer(hidden: int, ffn: int, experts: int, topk: int, ep: int, dtype=None, grouped: bool = False):
    """A megatron-core MoE layer (local spec: alltoall dispatcher, SequentialMLP experts; with ``grouped`` the
    legacy GroupedMLP, megatron-core 0.12 to 0.16, its grouped_gemm kernel on CPU ranks
    :mod:`coc_inject.testbed.grouped_gemm`'s); on CPU ranks with :func:`coc_inject.testbed.cpu.cpu_moe_shims`
    applied."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = dtype or torch.float32
    config = TransformerConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=8, ffn_hidden_size=ffn,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, moe_router_pre_softmax=topk == 1,
        moe_grouped_gemm=grouped)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped).submodules.mlp
    return spec(config=config) if callable(spec) else build_module(spec, config=config)
