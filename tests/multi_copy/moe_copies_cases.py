"""Multi-copy parallel through MoE layers on a real megatron-core MoE GPT (tests/moe/moe_cases.build_gpt:
SequentialMLP experts, the alltoall dispatcher), TP 2 with SP x EP 2 on 4 gloo ranks, each routing-loss
type, with and without COC_MOE_OVERLAP: the same training as without copies (losses, parameters, the
aux-loss tracker's values, the expert bias), every collective recorded in order on every rank."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from coc_inject import job
from coc_inject.config import AUTO, CocConfig
from coc_inject.multi_copy import collectives as copies_collectives, moe as copies_moe
from coc_inject.multi_copy.forward import last_route
from tests.moe import moe_cases
from tests.fakes import mindspeed_patches, recompute_rng
from tests.multi_copy.multi_copy_cases import CollectiveRecorder, autograd_on_one_thread

# Each routing-loss type as a TransformerConfig's settings.
ROUTING = {
    "aux_loss": dict(moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=0.1),
    "seq_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1),
    "z_loss": dict(moe_router_load_balancing_type="none", moe_z_loss_coeff=0.1),
    "expert_bias": dict(moe_router_load_balancing_type="none", moe_router_enable_expert_bias=True,
                        moe_router_score_function="sigmoid", moe_router_bias_update_rate=0.05),
    "all": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.05],
                moe_z_loss_coeff=0.1),
    # every loss and the expert bias at once (the recompute cases); without the batch aux_loss, which
    # Megatron's own MoE recompute forms one copy at a time (such blocks step aside)
    "every": dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"], moe_aux_loss_coeff=[0.1, 0.05],
                  moe_z_loss_coeff=0.1, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                  moe_router_bias_update_rate=0.05),
    "every_but_aux_loss": dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.05,
                               moe_z_loss_coeff=0.1, moe_router_enable_expert_bias=True,
                               moe_router_score_function="sigmoid", moe_router_bias_update_rate=0.05),
    "global_aux_loss": dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=0.1),
    "capacity": dict(moe_router_load_balancing_type="none", moe_expert_capacity_factor=1.0),
}


def _install(copies, moe_overlap):
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import moe_layer

    from coc_inject.moe import install as moe_install
    from coc_inject.multi_copy import install as copies_install

    if copies == 1 and moe_overlap == "0":
        return
    config = CocConfig(multi_copy=AUTO if copies == "auto" else copies, moe_overlap=moe_overlap,
                       tune_cache=None)
    if config.moe_armed:
        moe_install.install(config, moe_layer)
    if copies != 1:
        copies_install.install(config, transformer_block)


@contextlib.contextmanager
def _losses_per_copy():
    from coc_inject.multi_copy import moe as copies_moe

    copies = copies_moe._copies
    copies_moe._copies = lambda: None
    try:
        yield
    finally:
        copies_moe._copies = copies


def _tracker() -> dict:
    """Megatron's logged aux losses this step (per layer, this rank's), then zeroed as after logging."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19
        entries = {name: entry.values for name, entry in moe_utils.get_moe_metrics_tracker().metrics.items()}
    else:  # 0.12 to 0.16
        entries = {name: entry["values"] for name, entry in copies_moe.layer_wise_tracker().items()}
    values = {name: value.detach().clone() for name, value in entries.items()}
    for value in entries.values():
        value.zero_()
    return values


def _forget_tracker() -> None:
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):  # 0.19
        moe_utils.get_moe_metrics_tracker().metrics.clear()
    else:  # 0.12 to 0.16
        copies_moe.layer_wise_tracker().clear()


def train(copies=2, moe_overlap="0", routing="aux_loss", steps=3, b=4, seq=16, vocab=64, record=False,
          poison=False, per_copy_losses=False, adam=False, decisions=False, mindspeed_recompute=None, **model):
    """``per_copy_losses``: each copy forms its routing losses as Megatron does for one batch (the
    product's combination switched off: what the tests must catch). ``mindspeed_recompute``: the module of
    MindSpeed's whose block recompute replaces Megatron's (tests/fakes/mindspeed_patches.block_recompute)."""
    from megatron.core import parallel_state
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    moe_cases.setup(2, tp=2)  # CoC off, Megatron's TP 2 x EP 2 state
    _install(copies, moe_overlap)
    recompute_rng.install()  # with Transformer Engine's FP8 state off (selective 'layernorm')
    torch.manual_seed(7)
    gpt = moe_cases.build_gpt(seq=seq, vocab=vocab, ep=2, tp=2, sp=True, **{**ROUTING[routing], **model})
    optimizer = torch.optim.Adam(gpt.parameters(), lr=1e-3) if adam else torch.optim.SGD(gpt.parameters(), lr=0.1)
    routers = [m for m in gpt.modules() if isinstance(m, TopKRouter)]
    _forget_tracker()  # what an earlier case on this worker logged, sized for its layer count
    result = {"losses": [], "tracker": [], "tokens_per_expert": [], "expert_bias": [],
              "tp_rank": parallel_state.get_tensor_model_parallel_rank()}
    recorder = CollectiveRecorder() if record else None
    with contextlib.ExitStack() as inside:
        if per_copy_losses:
            inside.enter_context(_losses_per_copy())
        autograd_calls = inside.enter_context(autograd_on_one_thread())
        if poison:
            inside.enter_context(copies_collectives.poisoned())
        if recorder is not None:
            inside.enter_context(recorder)
        inside.callback(job.uninstall)
        if mindspeed_recompute is not None:
            applied = mindspeed_patches.Applied()
            inside.callback(applied.undo)
            mindspeed_patches.block_recompute(applied, mindspeed_recompute)
        for step in range(steps):
            generator = torch.Generator().manual_seed(100 * step + parallel_state.get_data_parallel_rank())
            tokens = torch.randint(vocab, (b, seq + 1), generator=generator)
            positions = torch.arange(seq).unsqueeze(0).expand(b, seq)
            causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
            optimizer.zero_grad(set_to_none=True)
            loss = gpt(tokens[:, :-1], positions, causal, labels=tokens[:, 1:]).sum() / (b * seq)
            loss.backward()
            moe_cases._sync_gradients(gpt)
            optimizer.step()
            result["losses"].append(loss.item())
            result["tracker"].append(_tracker())
            if routers[0].expert_bias is not None:
                result["tokens_per_expert"].append([r.local_tokens_per_expert.clone() for r in routers])
                _update_router_expert_bias([gpt], gpt.config)
                result["expert_bias"].append([r.expert_bias.clone() for r in routers])
                for router in routers:
                    router.local_tokens_per_expert.zero_()
        if copies == "auto" or decisions:
            result["decisions"] = [(key.text(), d.choice) for key, d in job.current().decisions(job.MULTI_COPY).items()]
    result["params"] = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    result["blocks"] = [(last_route(m).copies, last_route(m).reason) for m in gpt.modules()
                        if last_route(m) is not None]
    result["moe_routes"] = [moe_cases.route_of(m) for m in gpt.modules() if isinstance(m, MoELayer)
                            and hasattr(m, "_coc_moe")]
    result["autograd_calls"] = len(autograd_calls)
    result["collectives"] = recorder.calls if recorder is not None else None
    return result


def train_inner_choice(slow_pieces_ranks=(1,), **kwargs):
    """COC_MULTI_COPY=2 with COC_MOE_OVERLAP=auto: the block's trials of the copies with the MoE pieces
    inside half a second slower on ``slow_pieces_ranks`` only (a real delay): the block's decision
    and the MoE layers' routes come back with the training."""
    import time

    from coc_inject.multi_copy.auto import CopiesKey
    from coc_inject.routes import inner_of
    from coc_inject.tuning.online import Tuner

    decide = Tuner.decide

    def skewed(self, key, group, device, candidates, baseline, run, *args, **kw):
        def trial(choice):
            run(choice)
            if isinstance(key, CopiesKey) and inner_of(choice).experts and dist.get_rank() in slow_pieces_ranks:
                time.sleep(0.5)
        return decide(self, key, group, device, candidates, baseline, trial, *args, **kw)

    Tuner.decide = skewed
    try:
        result = train(copies=2, moe_overlap="auto", decisions=True, **kwargs)
    finally:
        Tuner.decide = decide
    return result


def dispatcher_left_as_found(copies=2):
    """After a copies' step every MoE layer holds Megatron's own dispatcher again."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    moe_cases.setup(2, tp=2)
    _install(copies, "0")
    try:
        gpt = moe_cases.build_gpt(seq=16, vocab=64, ep=2, tp=2, sp=True, **ROUTING["aux_loss"])
        held = {id(m): m.token_dispatcher for m in gpt.modules() if isinstance(m, MoELayer)}
        tokens = torch.randint(64, (4, 17), generator=torch.Generator().manual_seed(dist.get_rank() // 2))
        causal = torch.triu(torch.ones(1, 1, 16, 16, dtype=torch.bool), diagonal=1)
        gpt(tokens[:, :-1], torch.arange(16).expand(4, 16), causal, labels=tokens[:, 1:]).sum().backward()
        return {"same": all(m.token_dispatcher is held[id(m)] for m in gpt.modules() if isinstance(m, MoELayer)),
                "classes": sorted({type(m.token_dispatcher).__name__ for m in gpt.modules()
                                   if isinstance(m, MoELayer)}),
                "blocks": [last_route(m).copies for m in gpt.modules() if last_route(m) is not None]}
    finally:
        job.uninstall()
        _tracker()  # cleared, as a training loop's logging would
