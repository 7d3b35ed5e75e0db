"""A real megatron-core GPT trained the way a GPU job trains it, on every rank of a gloo pool.

Megatron's GPU defaults, not the ones the CPU makes easiest:

* **fused gradient accumulation**: ``gradient_accumulation_fusion=True``, Megatron's linears writing
  their weight gradients into ``main_grad`` through apex's kernel (tests/fakes/fused_wgrad.py's CPU
  stand-in, which checks the kernel's call contract and computes the true sum);
* **Megatron's DDP** with ``overlap_grad_reduce`` and ``use_distributed_optimizer`` (the gradient
  buckets reduce-scattered over the data-parallel group, in the backward), gradients in fp32;
* **fp32 or bf16** parameters and activations;
* **Megatron-LM's default fusions**: bias-GeLU (``bias_activation_fusion``: the fc1 linear hands its bias
  to the fused function, ``skip_bias_add``), bias-dropout-add (``bias_dropout_fusion``: so does the
  projection and fc2) and the fused masked softmax (``masked_softmax_fusion``: its CUDA extensions'
  CPU stand-ins, tests/fakes/fused_softmax.py, where its shapes allow). The first two are
  ``torch.compile``'d functions on a GPU; here they run eagerly (dynamo off for the case: the same
  functions on the same path through Megatron's layers, without minutes of CPU compilation).

The optimizer step is the distributed optimizer's for SGD: each rank's shard of every bucket is
the reduced gradient; the shards are all-gathered (the parameters' all-gather of a sharded update)
and every parameter takes ``p -= lr * main_grad``. The replicated sequence-parallel parameters'
gradients are summed over TP first, as Megatron's ``finalize_model_grads`` does. What comes back:
the losses, the global gradient norm and every parameter's reduced gradient of each step.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from tests.context_parallel import cp_gpt_cases
from tests.dist_harness import cpu_streams
from tests.fakes import fused_softmax, fused_wgrad
from tests.moe import moe_cases

LR = 0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TrialWatch:
    """Observes every ``auto``'s trials (tuning.online.Tuner._trials, wrapped, run unchanged): what
    they changed of the job's training state -- each parameter's ``main_grad`` and
    ``grad_added_to_main_grad``, DDP's per-bucket record of the gradients it has heard of, the RNG --
    and how many fused accumulations ran inside them. ``changes``: one line per change found."""

    def __init__(self, model, ddp):
        self.model, self.ddp = model, ddp
        self.changes: list = []
        self.trials = 0
        self.fused_inside = 0
        self.depth = 0

    def _state(self) -> dict:
        state = {f"{name}.main_grad": p.main_grad.clone() for name, p in self.model.named_parameters()}
        state.update({f"{name}.grad_added_to_main_grad": getattr(p, "grad_added_to_main_grad", None)
                      for name, p in self.model.named_parameters()})
        state.update({f"bucket group {i} heard of": dict(group.per_param_grad_ready_counts)
                      for i, group in enumerate(self.ddp.bucket_groups + self.ddp.expert_parallel_bucket_groups)})
        state["rng"] = torch.get_rng_state()
        return state

    def _compare(self, before: dict, after: dict) -> None:
        for name, value in before.items():
            other = after[name]
            same = torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
            if not same:
                self.changes.append(name)

    def __enter__(self):
        from coc_inject.tuning import online

        self._original = original = online.Tuner._trials
        watch = self

        def watched(tuner, *args, **kwargs):
            if watch.depth:  # trials inside trials (the copies' linears): the outermost ones are watched
                return original(tuner, *args, **kwargs)
            before, calls = watch._state(), len(fused_wgrad.calls)
            watch.depth += 1
            try:
                return original(tuner, *args, **kwargs)
            finally:
                watch.depth -= 1
                watch.trials += 1
                watch.fused_inside += len(fused_wgrad.calls) - calls
                watch._compare(before, watch._state())

        online.Tuner._trials = watched
        return self

    def __exit__(self, *exc):
        from coc_inject.tuning import online

        online.Tuner._trials = self._original


def _install(coc: dict | None, tp: int, cp: int, ep: int) -> None:
    """Megatron's parallel state for TP x CP x EP (the rest data-parallel) and every wing ``coc`` arms."""
    cp_gpt_cases.setup(tp, cp)  # its CPU shims for rotary embeddings and the causal mask
    cp_gpt_cases._parallel_state_key = None
    moe_cases._state_key = None
    moe_cases.setup(ep, tp=tp, coc=coc, cp=cp)
    moe_cases._state_key = None  # the next case initialises again


def _model(kind: str, tp: int, cp: int, ep: int, dtype, seq: int, vocab: int, heads: int = 4,
           softmax_fusion: bool = False, grouped: bool = False):
    """The GPT; in bf16 inside Megatron's Float16Module, as Megatron-LM wraps it (bf16 parameters and
    activations, the logits back in fp32). ``softmax_fusion``: Megatron's fused softmax (the CPU
    stand-ins of tests/fakes/fused_softmax.py) where its shapes allow."""
    from megatron.core.transformer.module import Float16Module

    fused = dict(gradient_accumulation_fusion=True, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                 bias_dropout_fusion=True, masked_softmax_fusion=softmax_fusion)
    if kind == "moe":
        model = moe_cases.build_gpt(seq=seq, vocab=vocab, ep=ep, tp=tp, sp=tp > 1, context_parallel_size=cp,
                                    grouped=grouped, **fused)
    else:  # the dense MLP's GeLU with its bias fused (the MoE experts have no bias)
        model = cp_gpt_cases.build_gpt(tp, cp, seq=seq, vocab=vocab, sp=tp > 1, heads=heads,
                                       bias_activation_fusion=True, **fused)
    return Float16Module(model.config, model) if dtype == torch.bfloat16 else model


def _reduced_gradients(ddp, model) -> dict:
    """Every parameter's reduced gradient: the distributed optimizer's shards all-gathered."""
    from megatron.core import parallel_state

    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        group = buffer.data_parallel_group
        size, rank = group.size(), group.rank()
        for bucket in buffer.buckets:
            shards = bucket.grad_data.view(size, -1)
            mine = shards[rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False):
            dist.all_reduce(param.main_grad, group=tp_group)
    return {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}


def _global_norm(grads: dict, model) -> float:
    """The L2 norm of the whole model's gradient: each TP shard once, replicated parameters once."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    replicated = torch.zeros(1, dtype=torch.float64)
    sharded = torch.zeros(1, dtype=torch.float64)
    for name, param in model.named_parameters():
        square = grads[name].double().square().sum()
        if getattr(param, "tensor_model_parallel", False):
            sharded += square
        else:
            replicated += square
    dist.all_reduce(sharded, group=tp_group)
    return float((sharded + replicated).sqrt())


def document_mask(seq: int) -> torch.Tensor:
    """Megatron-LM's mask under ``--reset-attention-mask``: causal within each document, nothing across
    (documents of 10, 11 and 11 tokens at 32: boundaries on both sides of the copies' split)."""
    starts = torch.tensor([0, seq * 5 // 16, seq * 21 // 32])
    document = torch.bucketize(torch.arange(seq), starts, right=True)
    position = torch.arange(seq)
    return ((position[None, :] > position[:, None]) | (document[None, :] != document[:, None]))[None, None]


@contextlib.contextmanager
def softmax_watch(found: dict):
    """Every score matrix Megatron's softmax sees (a non-square one: ``found["nonsquare"]``) and every
    device-to-host read of a mask's classification (``found["mask_reads"]``)."""
    from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax

    from coc_inject.context_parallel import masks

    original, read = FusedScaleMaskSoftmax.forward, masks._read
    found.update(nonsquare=[], mask_reads=0)

    def forward(self, input, mask, *args, **kwargs):
        if input.shape[-2] != input.shape[-1]:
            found["nonsquare"].append(tuple(input.shape))
        return original(self, input, mask, *args, **kwargs)

    def counted(flags):
        found["mask_reads"] += 1
        return read(flags)

    FusedScaleMaskSoftmax.forward, masks._read = forward, counted
    try:
        yield
    finally:
        FusedScaleMaskSoftmax.forward, masks._read = original, read


def train(coc: dict | None = None, kind: str = "dense", dtype: str = "fp32", tp: int = 2, cp: int = 1, ep: int = 1,
          steps: int = 3, b: int = 4, seq: int = 32, vocab: int = 128, mask: str = "causal", heads: int = 4,
          softmax_fusion: bool = True, grouped: bool = False) -> dict:
    """``steps`` steps of the GPT (``kind``: "dense" or "moe") under Megatron's GPU defaults (module
    docstring) with coc-inject's wings as ``coc`` arms them (None: off). Each rank's data-parallel
    replica takes its own batch. ``mask``: "causal" or "document" (document_mask). ``grouped``: the MoE
    experts the legacy GroupedMLP (the grouped_gemm stand-in installed)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from coc_inject import job

    watched: dict = {}
    with cpu_streams(), fused_wgrad.installed(), fused_softmax.installed(), contextlib.ExitStack() as undo:
        undo.callback(job.uninstall)
        held_dynamo = torch._dynamo.config.disable
        torch._dynamo.config.disable = True  # Megatron's jit-fused functions eagerly (module docstring)
        undo.callback(setattr, torch._dynamo.config, "disable", held_dynamo)
        _install(coc, tp, cp, ep)
        undo.enter_context(softmax_watch(watched))
        if grouped:
            from tests.fakes import grouped_gemm

            undo.enter_context(grouped_gemm.installed())
        model = _model(kind, tp, cp, ep, DTYPES[dtype], seq, vocab, heads, softmax_fusion, grouped)
        ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=True, grad_reduce_in_fp32=True))
        watch = undo.enter_context(TrialWatch(model, ddp))
        causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        if mask == "document":
            causal = document_mask(seq)
        data_rank = parallel_state.get_data_parallel_rank()
        losses, norms, grads = [], [], []
        for step in range(steps):
            tokens, labels = cp_gpt_cases.batch(1000 * data_rank + step, b, seq, vocab)
            positions = torch.arange(seq).unsqueeze(0).expand(b, seq)
            step_mask = causal
            if cp > 1:
                rank = parallel_state.get_context_parallel_rank()
                tokens, labels, positions = (cp_gpt_cases.cp_slice(t, 1, cp, rank) for t in (tokens, labels, positions))
                step_mask = cp_gpt_cases.cp_slice(causal, 2, cp, rank)
            ddp.zero_grad_buffer()
            loss = ddp(tokens, positions, step_mask, labels=labels).float().sum() / (b * seq)
            loss.backward()
            ddp.finish_grad_sync()
            reduced = _reduced_gradients(ddp, model)
            norms.append(_global_norm(reduced, model))
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param -= (LR * reduced[name]).to(param.dtype)
            total = loss.detach().double()
            dist.all_reduce(total, group=parallel_state.get_context_parallel_group())
            losses.append(float(total))
            grads.append(reduced)
        fused_calls = len(fused_wgrad.calls)
        linear_calls = _linear_calls()
        softmax_calls = sorted({name for name, _ in fused_softmax.calls})
        routes = _routes(model)
        decisions = [f"{wing}: {decision.describe(key)}" for wing, tuner in job.current().tuners.items()
                     for key, decision in tuner.decisions.items()] if job.current() is not None else []
    return {"losses": losses, "norms": norms, "grads": grads, "fused_calls": fused_calls, "routes": routes,
            "linear_calls": linear_calls,
            "decisions": decisions, "trials": watch.trials, "trial_changes": watch.changes,
            "fused_in_trials": watch.fused_inside, "softmax_calls": softmax_calls, **watched}


def _routes(model) -> dict:
    """What each wing's layers ran (their last call's route), by wing."""
    from coc_inject.multi_copy.forward import last_route

    found: dict = {}
    for module in model.modules():
        for attribute in ("_coc_multi_copy", "_coc_moe", "_coc_cp"):  # multi-copy's is kept off the block
            route = last_route(module) if attribute == "_coc_multi_copy" else getattr(module, attribute, None)
            if route is not None:
                found.setdefault(attribute, set()).add(getattr(route, "reason", None) or repr(route)[:80])
    return {wing: sorted(map(str, reasons)) for wing, reasons in found.items()}


def _linear_calls() -> int:
    """Linear calls the linears wing ran (chunked or fused) in this case; 0 without it."""
    from coc_inject import job

    installation = job.current()
    engine = getattr(installation, "engine", None) if installation is not None else None
    return getattr(engine, "calls", 0) if engine is not None else 0
