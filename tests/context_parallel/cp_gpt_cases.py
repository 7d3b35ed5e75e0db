"""A tiny Megatron-core GPT (local spec) trained for a few steps on every rank of a gloo pool, at
CP=1 with Megatron's own attention or at CP>1 through coc-inject: what the CP tests compare.

The training step is Megatron-LM's for CP: the batch is cut with Megatron's layout (2*CP chunks,
rank r keeps r and 2*CP-1-r: tokens, labels, positions, the mask's rows), the loss is the sum of
this rank's token losses over the global token count, and gradients are summed over the CP group
(what Megatron's DDP does over its data-and-context-parallel group) and, for the replicated
sequence-parallel parameters, over the TP group.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from coc_inject import job
from coc_inject.testbed.cpu import CpuLayerNorm
from coc_inject.testbed.memory import SavedBytes
from coc_inject.config import CocConfig
from coc_inject.context_parallel import auto, groups, install, layout
from tests.dist_harness import reinitialize_model_parallel

SEED = 1234
_parallel_state_key = None  # what initialize_model_parallel last ran with (making groups takes seconds)


def _cpu_pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group=None):
    """Test-only shim: Megatron's get_pos_emb_on_this_cp_rank builds its index with pin_memory().cuda()
    (0.12's takes no cp_group: parallel_state's)."""
    if cp_group is None:
        from megatron.core import parallel_state

        cp_group = parallel_state.get_context_parallel_group()
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank]))
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def setup(tp: int, cp: int, coc: dict | CocConfig | None = None, hierarchical=None):
    """Megatron's parallel state for TP x CP (the rest data-parallel), coc-inject's CP installed for ``coc``."""
    from megatron.core import parallel_state
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.transformer import dot_product_attention

    rotary_pos_embedding.get_pos_emb_on_this_cp_rank = _cpu_pos_emb_on_this_cp_rank
    # Test-only shim for the CP=1 reference: Megatron's default causal mask is made on "cuda".
    fused_softmax.get_default_causal_mask = lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(1)
    global _parallel_state_key
    install.uninstall()
    if coc is not None:
        install.install(coc if isinstance(coc, CocConfig) else CocConfig(**coc), dot_product_attention, parallel_state)
    degree = coc.cp_ulysses_degree if isinstance(coc, CocConfig) else (coc or {}).get("cp_ulysses_degree")
    key = (tp, cp, hierarchical, degree)
    if key != _parallel_state_key:
        groups.release()
        reinitialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                    hierarchical_context_parallel_sizes=hierarchical)
        _parallel_state_key = key


def ulysses_groups_destroyed_with_megatrons():
    """Hybrid's Ulysses group: live after initialize_model_parallel, destroyed by destroy_model_parallel."""
    from megatron.core import parallel_state

    global _parallel_state_key
    setup(1, 4, coc={"cp_algo": "hybrid", "cp_ulysses_degree": 2})
    group = groups.ulysses_group(2, None, parallel_state)
    live = group in dist.distributed_c10d._world.pg_map
    parallel_state.destroy_model_parallel()
    _parallel_state_key = None  # the next setup initialises again
    return {"live": live, "destroyed": group not in dist.distributed_c10d._world.pg_map,
            "forgotten": groups.ulysses_group(2, None, parallel_state) is None}


def build_gpt(tp, cp, *, heads=4, groups=None, hidden=64, layers=2, seq=64, vocab=128, rope=False, sp=False,
              cp_comm_type=None, hierarchical=None, mask_type=None, pre_process=True, post_process=True, **extra):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(SEED)
    from coc_inject.testbed.models import fresh_rng_tracker

    fresh_rng_tracker()
    settings = dict(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=4 * hidden, tensor_model_parallel_size=tp, context_parallel_size=cp,
        pipeline_model_parallel_size=1, sequence_parallel=sp, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        **({"cp_comm_type": cp_comm_type} if cp_comm_type is not None else {}),
        **({"hierarchical_context_parallel_sizes": hierarchical} if hierarchical else {}))
    config = TransformerConfig(**{**settings, **extra})
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    if mask_type is not None:
        from megatron.core.transformer.enums import AttnMaskType

        spec.submodules.self_attention.params["attn_mask_type"] = getattr(AttnMaskType, mask_type)
    block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=CpuLayerNorm)
    return GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab, max_sequence_length=seq,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=pre_process and post_process,
                    position_embedding_type="rope" if rope else "learned_absolute")


def batch(step, b, seq, vocab):
    generator = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(vocab, (b, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def cp_slice(tensor, dim, cp, cp_rank):
    """Megatron's get_batch_on_this_cp_rank layout along ``dim``."""
    chunk = tensor.shape[dim] // (2 * cp)
    rows = layout.global_positions(layout.rank_chunks(cp_rank, cp), chunk)
    return tensor.index_select(dim, torch.tensor(rows))


def _skew_trials(name, seconds):
    """This rank's trial runs of the algorithm ``name`` take ``seconds`` longer (a real delay)."""
    from coc_inject.tuning.online import Tuner, cache_for

    config = job.current().config
    tuner = job.current().tuners[job.ATTENTION] = Tuner(config, cache_for(config))
    decide = tuner.decide

    def skewed_decide(key, group, device, candidates, baseline, run, group_name="TP", **kwargs):
        def trial(candidate):
            run(candidate)
            if candidate == name:
                time.sleep(seconds)
        return decide(key, group, device, candidates, baseline, trial, group_name, **kwargs)

    tuner.decide = skewed_decide


def train(tp, cp, coc=None, steps=3, b=2, seq=64, vocab=128, mask="full", call_twice=False, skew=None,
          after_setup=None, autocast=False, keep_grads=False, **model_kwargs):
    """Losses per step and this rank's parameters after ``steps`` SGD steps. ``autocast``: forward and
    backward inside CPU torch.autocast in bf16 (Megatron's enable_autocast; its linears' custom_bwd runs
    their backward under the forward's autocast on CUDA, the CPU backward needs the context around it).
    ``keep_grads``: the last step's gradients (summed as above) come back too.

    SGD, not Adam: Adam turns the rounding noise of a gradient that is zero in exact arithmetic
    (the key part of the QKV bias: softmax ignores a shift shared by all keys) into full-size
    updates, which would hide real gradient differences behind noise."""
    from megatron.core import parallel_state

    setup(tp, cp, coc, model_kwargs.get("hierarchical"))
    if after_setup is not None:  # more of coc-inject, installed for the same config
        after_setup()
    if skew and dist.get_rank() in skew:
        _skew_trials(*skew[dist.get_rank()])
    model = build_gpt(tp, cp, seq=seq, vocab=vocab, **model_kwargs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    cp_group, tp_group = parallel_state.get_context_parallel_group(), parallel_state.get_tensor_model_parallel_group()
    cp_rank = parallel_state.get_context_parallel_rank()
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    losses = []
    for step in range(steps):
        tokens, labels = batch(step, b, seq, vocab)
        positions = torch.arange(seq).unsqueeze(0).expand(b, seq)
        padding = causal.clone()
        padding[..., 3] = True  # one padded key: neither causal nor empty (COC_FLASH_ATTN: Megatron's path)
        attention_mask = {"full": causal, "none": None, "padding": padding}[mask]
        if cp > 1:
            tokens, labels, positions = (cp_slice(t, 1, cp, cp_rank) for t in (tokens, labels, positions))
            attention_mask = None if attention_mask is None else cp_slice(attention_mask, 2, cp, cp_rank)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            per_token = model(tokens, positions, attention_mask, labels=labels)
            loss = per_token.float().sum() / (b * seq)
            if call_twice:  # the same layers run a second time in this step
                loss = loss + model(tokens, positions, attention_mask, labels=labels).sum() / (b * seq)
            loss.backward()
        for param in model.parameters():
            if param.grad is None:
                continue
            if cp > 1:
                dist.all_reduce(param.grad, group=cp_group)
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=tp_group)
        optimizer.step()
        total = loss.detach().clone()
        if cp > 1:
            dist.all_reduce(total, group=cp_group)
        losses.append(total.item())
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if keep_grads and p.grad is not None}
    plans = [m._coc_cp for m in model.modules() if getattr(m, "_coc_cp", None)]
    algorithms = sorted({plan.describe() for plan in plans})
    kernels = sorted({choice.name for plan in plans for choice in plan.kernels.values()})
    decisions = [{"key": key.text(), "choice": d.choice, "source": d.source, "times_ms": d.times_ms}
                 for key, d in auto.decisions().items()]
    return {"losses": losses, "params": params, "grads": grads, "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
            "algorithms": algorithms, "kernels": kernels, "decisions": decisions,
            "cp_ranks": list(parallel_state.get_context_parallel_global_ranks())}


def saved_attention_bytes(tp, cp, coc=None, seq=256, b=1, heads=4, dim=16):
    """Bytes the attention core keeps for backward on this rank (saved_tensors_hooks) for one call."""
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    setup(tp, cp, coc)
    model = build_gpt(tp, cp, heads=heads, hidden=heads * dim, layers=1, seq=seq)
    layer = next(m for m in model.modules() if isinstance(m, DotProductAttention))
    local = seq // cp
    generator = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(local, b, heads // tp, dim, generator=generator, requires_grad=True) for _ in range(3))
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
    if cp > 1:
        mask = cp_slice(mask, 2, cp, parallel_state.get_context_parallel_rank())
    with SavedBytes() as saved:
        out = layer(q, k, v, mask, attn_mask_type=AttnMaskType.causal)
    out.sum().backward()  # it must still run backward
    return saved.total


def expect_error(tp, cp, coc, what="build", **model_kwargs):
    """The message of the error a CP setup raises at construction (``build``) or at the first call."""
    try:
        if what == "build":
            setup(tp, cp, coc, model_kwargs.get("hierarchical"))
            build_gpt(tp, cp, **model_kwargs)
        else:
            train(tp, cp, coc, steps=1, **model_kwargs)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return None


def attention_call_error(tp, cp, coc, **call):
    """The error of one attention call with ``call`` overrides (packed_seq_params, attention_bias, mask, rows,
    autocast: the call inside CPU torch.autocast in bf16)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    setup(tp, cp, coc)
    model = build_gpt(tp, cp, layers=1)
    layer = next(m for m in model.modules() if isinstance(m, DotProductAttention))
    rows = call.pop("rows", 32)
    q = k = v = torch.randn(rows, 1, 4, 16)
    mask = call.pop("mask", None)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=call.pop("autocast", False)):
            layer(q, k, v, mask, **call)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return None


def subclass_with_own_forward_error(coc):
    """A DotProductAttention subclass that overrides forward, built with CP=2: Megatron's own refusal."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class OwnForward(DotProductAttention):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    setup(1, 2, coc)
    config = build_gpt(1, 2, layers=1).config
    try:
        OwnForward(config, 1, AttnMaskType.causal, "self")
    except AssertionError as error:
        return str(error)
    return None
