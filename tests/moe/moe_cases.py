"""Worker functions for tests/moe/test_moe.py: a real megatron-core MoE layer, and a tiny GPT with MoE
layers, on gloo ranks with expert parallelism, unpatched and with COC_MOE_OVERLAP.

Every parameter starts from a seed of its GLOBAL name (an expert's by its global expert index), so
every rank's local experts differ and a token sent to the wrong rank or expert changes the result.
"""

from __future__ import annotations

import time
import zlib

import torch
import torch.distributed as dist

from coc_inject import job
from coc_inject.testbed.cpu import CpuLayerNorm, cpu_moe_shims
from coc_inject.config import CocConfig
from coc_inject.multi_copy.forward import last_route
from tests.dist_harness import reinitialize_model_parallel
from tests.fakes import grouped_gemm, recompute_rng, uneven_collectives

_state_key = None


def cpu_shims() -> None:
    """Test-only shims for Megatron's MoE code on CPU (each one what that code needs, nothing more)."""
    from megatron.core.transformer.moe import moe_utils

    # The alltoall dispatcher's side stream for its split counts, and gloo's list-only split sizes:
    # the bench's CPU ranks need the same (one copy, there).
    cpu_moe_shims()
    # NCCL's uneven list forms, which Megatron's expert TP uses and gloo refuses: the stand-ins.
    uneven_collectives.install()
    # Megatron's grouped_gemm extension (CUDA only) for the legacy GroupedMLP: the CPU stand-in.
    grouped_gemm.install()
    # 0.16's router names Transformer Engine's GEMM, defined only when TE imports.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def setup(ep: int, tp: int = 1, etp: int = 1, coc: dict | None = None, cp: int = 1, chunks: int | None = None) -> None:
    """Megatron's parallel state for TP x CP x EP (expert TP ``etp``); the MoE wing installed for
    ``coc``, and with it the other wings ``coc`` arms (one installation: they compose)."""
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention
    from megatron.core.transformer.moe import moe_layer

    from coc_inject.linears import install as linears
    from coc_inject.context_parallel import install as cp_install
    from coc_inject.moe import install

    global _state_key
    cpu_shims()
    job.uninstall()
    if coc is not None:
        config = CocConfig(**coc)
        if config.cp_algorithm:  # first: its install() starts the installation afresh
            cp_install.install(config, dot_product_attention, parallel_state)
        if config.enabled:
            linears.install(config)
        install.install(config, moe_layer, chunks)
        if config.multi_copy_armed:  # the same installation: the wings compose
            from megatron.core.transformer import transformer_block

            from coc_inject.multi_copy import install as copies

            copies.install(config, transformer_block)
    key = (ep, tp, etp, cp)
    if key != _state_key:
        reinitialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                    expert_tensor_parallel_size=etp, context_parallel_size=cp)
        _state_key = key


def seed_parameters(module, local_experts: int) -> None:
    """Each parameter from a seed of its global name: local expert j of EP rank r is expert r * L + j."""
    from megatron.core import parallel_state

    first = parallel_state.get_expert_model_parallel_rank() * local_experts
    for name, param in module.named_parameters():
        if ".local_experts." in name:
            head, _, rest = name.partition(".local_experts.")
            index, _, tail = rest.partition(".")
            name = f"{head}.experts.{first + int(index)}.{tail}"
        elif name.startswith(("experts.weight", "experts.linear_fc")) or ".experts.weight" in name:
            # GroupedMLP's weights (all local experts'), TEGroupedMLP's weight{i}: seeded per EP rank
            name = f"{name}.ep{parallel_state.get_expert_model_parallel_rank()}"
        generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


def moe_config(*, experts=4, topk=2, hidden=16, ep=2, tp=1, etp=1, sp=False, config_class=None, **extra):
    """``config_class``: "module:name" of a TransformerConfig subclass to build instead (a Bridge-like provider)."""
    import importlib

    from megatron.core.transformer.transformer_config import TransformerConfig

    if config_class is not None:
        module, _, name = config_class.partition(":")
        TransformerConfig = getattr(importlib.import_module(module), name)  # noqa: N806

    settings = dict(
        num_layers=1, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=2 * hidden,
        num_moe_experts=experts, moe_router_topk=topk, moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep, tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp,
        sequence_parallel=sp, moe_aux_loss_coeff=0.0, add_bias_linear=False, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, params_dtype=torch.float32,
        moe_router_pre_softmax=topk == 1)  # Megatron asks for pre-softmax routing at top-1
    return TransformerConfig(**{**settings, **extra})


def build_layer(grouped=False, te_grouped=False, **kwargs):
    """Megatron's MoE layer of the local spec: SequentialMLP experts, or with ``grouped`` the legacy
    GroupedMLP (``--moe-grouped-gemm``; its grouped_gemm extension: tests/fakes/grouped_gemm.py), or with
    ``te_grouped`` Megatron's TEGroupedMLP over stand-ins of TE's grouped linears (tests/fakes/te_grouped_linear.py:
    a builder on 0.17+, a ModuleSpec before)."""
    import dataclasses
    import functools

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = moe_config(**kwargs, **({"moe_grouped_gemm": True} if grouped or te_grouped else {}))
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=grouped).submodules.mlp
    if te_grouped:
        from tests.fakes import te_grouped_linear

        if isinstance(spec, functools.partial):  # 0.17+: a builder
            submodules = dataclasses.replace(spec.keywords["submodules"], experts=te_grouped_linear.experts_builder())
            spec = functools.partial(spec.func, submodules=submodules)
        else:  # 0.12-0.16: a ModuleSpec
            spec = dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules,
                                                                            experts=te_grouped_linear.experts_spec()))
    layer = spec(config=config) if callable(spec) else build_module(spec, config=config)  # 0.13-0.15: a ModuleSpec
    seed_parameters(layer, layer.num_local_experts)
    return layer


def layer_input(kind: str, tokens: int, hidden: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + dist.get_rank())
    x = torch.randn(tokens, 1, hidden, generator=generator)
    return x.abs() if kind == "positive" or (kind == "positive on rank 0" and dist.get_rank() == 0) else x


def _shun_expert(layer, expert: int) -> None:
    """The router's weight row for ``expert`` all negative: a positive input never picks it."""
    with torch.no_grad():
        layer.router.weight[expert] = -layer.router.weight[expert].abs() - 1.0


def _step(layer, x):
    x = x.clone().requires_grad_()
    out, _ = layer(x)
    weights = torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape).sin()
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    for p in layer.parameters():
        p.grad = None
    return out.detach(), x.grad, grads


def route_of(layer) -> tuple:
    """The layer's last MoERoute as ("pieces", chunks per expert) or ("megatron", reason)."""
    route = layer._coc_moe
    return ("pieces", route.chunks) if route.pieces else ("megatron", route.reason)


class AllToAllRecorder:
    """Every all_to_all_single on this rank in order: (group ranks, output splits, input splits); and
    the devices of their tensors (NCCL/HCCL take only the job's device)."""

    def __enter__(self):
        from coc_inject import dist_interception

        self.calls, self.devices = [], set()
        self._replaced = dist_interception.replaced(self._recording, ("all_to_all_single",))
        self._replaced.__enter__()
        return self

    def _recording(self, name, original):
        def record(output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kwargs):
            as_list = lambda sizes: [int(s) for s in sizes] if sizes is not None else None  # noqa: E731
            self.calls.append((tuple(dist.get_process_group_ranks(group)) if group is not None else "world",
                               as_list(output_split_sizes), as_list(input_split_sizes)))
            self.devices.update((str(output.device), str(input.device)))
            return original(output, input, output_split_sizes, input_split_sizes, group=group, **kwargs)

        record._splits_as_lists = True
        return record

    def __exit__(self, *exc):
        self._replaced.__exit__(None, None, None)


def layer_case(ep=2, experts=4, topk=2, tokens=24, hidden=16, coc=None, kind="random", shun=None, etp=1, chunks=None,
               autocast=False, **model):
    """Megatron's MoE layer unpatched, then with ``coc``: output, input gradient and parameter
    gradients (max abs differences), the route, and the patched run's all-to-alls. ``autocast``: both
    steps inside CPU torch.autocast in bf16 (Megatron's enable_autocast)."""
    setup(ep, etp=etp, coc=None)
    layer = build_layer(experts=experts, topk=topk, hidden=hidden, ep=ep, etp=etp, **model)
    if shun is not None:
        _shun_expert(layer, shun)
    x = layer_input(kind, tokens, hidden).to(layer.config.params_dtype)
    autocasting = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)  # noqa: E731
    with AllToAllRecorder() as unpatched, autocasting():
        want = _step(layer, x)
    setup(ep, etp=etp, coc=coc or {"moe_overlap": "1"}, chunks=chunks)
    with AllToAllRecorder() as patched, autocasting():
        got = _step(layer, x)
    dispatcher = layer.token_dispatcher
    counts = getattr(dispatcher, "num_global_tokens_per_local_expert" if layer.num_local_experts > 1 else "output_splits",
                     None)
    return {
        "route": route_of(layer),
        "out": (got[0] - want[0]).abs().max().item(), "out_scale": want[0].abs().max().item(),
        "x_grad": (got[1] - want[1]).abs().max().item(),
        "param_grad": max((got[2][n] - w).abs().max().item() for n, w in want[2].items()),
        "param_grad_scale": max(w.abs().max().item() for w in want[2].values()),
        "same_params": sorted(got[2]) == sorted(want[2]),
        "received": None if counts is None else torch.as_tensor(counts).tolist(),
        "unpatched_calls": unpatched.calls, "calls": patched.calls,
        "off_device": sorted(patched.devices - {str(x.device)}),
    }


def slow_pieces_trials(seconds: float) -> None:
    """On this rank, every trial of the pieces takes ``seconds`` longer (a real delay)."""
    from coc_inject.moe import auto

    choose = auto.choose

    def slowed(tuner, key, group, tokens, probs, run_megatron, run_pieces, experts):
        def pieces(t, p, chunks):
            time.sleep(seconds)
            return run_pieces(t, p, chunks)

        return choose(tuner, key, group, tokens, probs, run_megatron, pieces, experts)

    auto.choose = slowed


def auto_case(slow_ranks=(), **case):
    """layer_case with COC_MOE_OVERLAP=auto (``slow_ranks``: whose pieces trials are slowed), and the
    decision the layer's tuner made."""
    from coc_inject.moe import auto

    choose = auto.choose
    if dist.get_rank() in slow_ranks:
        slow_pieces_trials(0.5)
    try:
        result = layer_case(coc={"moe_overlap": "auto"}, **case)
    finally:
        auto.choose = choose
    decisions = job.current().decisions(job.MOE)
    result["decisions"] = [(key.text(), d.choice, d.source) for key, d in decisions.items()]
    return result


def build_gpt(*, layers=2, hidden=32, experts=4, topk=2, seq=16, vocab=64, tp=1, etp=1, ep=2, sp=False, grouped=False,
              **extra):
    """A tiny GPT whose MLPs are MoE layers (Megatron's local spec: SequentialMLP experts; ``grouped``: the
    legacy GroupedMLP, --moe-grouped-gemm)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from coc_inject.testbed.models import fresh_rng_tracker

    fresh_rng_tracker()
    config = moe_config(experts=experts, topk=topk, hidden=hidden, ep=ep, tp=tp, etp=etp, sp=sp,
                        **{"num_layers": layers, "hidden_dropout": 0.0, "attention_dropout": 0.0,
                           "bias_dropout_fusion": False, "masked_softmax_fusion": False,
                           "persist_layer_norm": False, "cross_entropy_loss_fusion": False,
                           **({"moe_grouped_gemm": True} if grouped else {}), **extra})
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=grouped)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    block = TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=CpuLayerNorm)
    model = GPTModel(config=config, transformer_layer_spec=block, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="learned_absolute")
    seed_parameters(model, experts // ep)
    return model


def _sync_gradients(model) -> None:
    """What Megatron's DDP does: expert gradients summed over the expert-data-parallel group, the
    others over the data-parallel group (and the replicated sequence-parallel ones over TP)."""
    from megatron.core import parallel_state

    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        expert = ".local_experts." in name or ".experts.weight" in name  # SequentialMLP's, GroupedMLP's
        group = (parallel_state.get_expert_data_parallel_group() if expert
                 else parallel_state.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(param.grad, group=group)
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.grad, group=parallel_state.get_tensor_model_parallel_group())


def train_gpt(coc=None, steps=3, b=2, seq=16, vocab=64, ep=2, tp=1, etp=1, cp=1, **model):
    """Losses and parameters after ``steps`` SGD steps of the MoE GPT; the MoE layers' last routes.
    With ``cp`` > 1 each rank keeps its share of the sequence as Megatron-LM cuts it (the loss over the
    global token count), coc-inject's context parallelism running the attention."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from tests.context_parallel.cp_gpt_cases import cp_slice

    setup(ep, tp=tp, etp=etp, coc=coc, cp=cp)
    recompute_rng.install()
    torch.manual_seed(7)
    gpt = build_gpt(seq=seq, vocab=vocab, ep=ep, tp=tp, etp=etp, context_parallel_size=cp, **model)
    optimizer = torch.optim.SGD(gpt.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        data_rank = parallel_state.get_data_parallel_rank()
        generator = torch.Generator().manual_seed(100 * step + data_rank)  # a batch per model replica
        tokens = torch.randint(vocab, (b, seq + 1), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(seq).unsqueeze(0).expand(b, seq)
        causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        if cp > 1:
            rank = parallel_state.get_context_parallel_rank()
            inputs, labels, positions = (cp_slice(t, 1, cp, rank) for t in (inputs, labels, positions))
            causal = cp_slice(causal, 2, cp, rank)
        optimizer.zero_grad(set_to_none=True)
        loss = gpt(inputs, positions, causal, labels=labels).sum() / (b * seq)
        loss.backward()
        _sync_gradients(gpt)
        optimizer.step()
        losses.append(loss.item())
    routes = [route_of(m) for m in gpt.modules() if isinstance(m, MoELayer) and hasattr(m, "_coc_moe")]
    blocks = [last_route(m).reason for m in gpt.modules() if last_route(m) is not None]
    installation = job.current()
    engine = getattr(installation, "engine", None) if installation is not None else None
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in gpt.named_parameters()}, "routes": routes,
            "blocks": blocks, "linear_calls": getattr(engine, "calls", 0), "config_class": type(gpt.config).__name__}


def refusal_reasons() -> dict:
    """guards.layer_reason for layers the pieces do not run, each built for real where it can be
    here; Transformer Engine's grouped experts and the flex dispatcher (DeepEP) cannot be built
    without their libraries: a real layer with an object of that class name in their place."""
    import copy

    from coc_inject.moe import guards

    def named(name):
        return type(name, (torch.nn.Module,), {})()

    reasons = {}
    setup(1)
    reasons["EP 1"] = guards.layer_reason(build_layer(ep=1))
    setup(2)
    reasons["allgather"] = guards.layer_reason(build_layer(moe_token_dispatcher_type="allgather"))
    for attribute in ("moe_permute_fusion", "overlap_moe_expert_parallel_comm", "moe_shared_expert_overlap",
                      "moe_pad_expert_input_to_capacity", "fp8", "delay_wgrad_compute"):
        layer = build_layer()
        if not hasattr(layer.config, attribute):  # a later release's field (0.13: overlap_moe_expert_parallel_comm)
            continue
        layer.config = copy.copy(layer.config)
        setattr(layer.config, attribute, "e4m3" if attribute == "fp8" else True)
        reasons[attribute] = guards.layer_reason(layer)
    layer = build_layer()
    layer.experts = named("InferenceGroupedMLP")  # 0.19's inference experts (a TEGroupedMLP subclass)
    reasons["other experts"] = guards.layer_reason(layer)
    if hasattr(layer.config, "use_transformer_engine_op_fuser"):  # 0.17+: TEGroupedMLP's fused path
        layer = build_layer(te_grouped=True)
        layer.experts._with_fused_impl = True
        reasons["TE op fuser"] = guards.layer_reason(layer)
    layer.token_dispatcher = named("MoEFlexTokenDispatcher")
    reasons["flex"] = guards.layer_reason(layer)
    reasons["alltoall + SequentialMLP"] = guards.layer_reason(build_layer())
    return reasons


def ragged_auto_case(tokens_by_rank, ep=2, experts=4, topk=2, hidden=16):
    """COC_MOE_OVERLAP=auto over calls whose token counts differ between the ranks of an EP group
    (data-parallel ranks with other sequence lengths): ``tokens_by_rank[rank]`` per call, each forward
    and backward. Every rank must reach the decision at the same call (a per-token-count key would
    send one rank into trials alone: a hang). Returns the decisions and each call's route."""
    setup(ep, coc={"moe_overlap": "auto"})
    layer = build_layer(experts=experts, topk=topk, hidden=hidden, ep=ep)
    routes = []
    for tokens in tokens_by_rank[dist.get_rank()]:
        _step(layer, layer_input("random", tokens, hidden))
        routes.append(route_of(layer))
    decisions = job.current().decisions(job.MOE)
    return {"decisions": [(key.text(), d.choice, d.source) for key, d in decisions.items()], "routes": routes}
