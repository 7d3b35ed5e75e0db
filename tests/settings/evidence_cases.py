"""Work run on every rank of a gloo pool by tests/settings/test_evidence.py: for each field, Megatron's
smallest real case of a wing built with that field off its default (coc_inject.allowlist.evidence.CPU_VALUES),
run with the wing off and on; what comes back is, per field and wing, how far apart the two are, whether the
wing ran or why it stepped aside, or the error.

A field set through Megatron's schedule rather than a layer is applied as the schedule applies it
(``enable_autocast``: the forward inside ``torch.autocast`` on the tensors' device, as
``pipeline_parallel/schedules.py``'s forward_step does with "cuda" on a GPU)."""

from __future__ import annotations

import contextlib
import traceback
import types

import torch
import torch.distributed as dist

from coc_inject.allowlist import evidence


def _resolve(value):
    """CPU_VALUES names torch's dtypes and functions and Megatron's enums by strings (the data imports neither)."""
    if isinstance(value, str) and value.startswith("torch."):
        import operator

        return operator.attrgetter(value[len("torch."):])(torch)
    if isinstance(value, str) and value.startswith("AttnBackend."):
        from megatron.core.transformer.enums import AttnBackend

        return getattr(AttnBackend, value.split(".")[1])
    return value


def _settings(field: str) -> dict:
    settings = {name: _resolve(value) for name, value in evidence.CPU_VALUES[field].items()}
    settings[field] = settings.pop("value")
    return settings


def _schedule_context(config):
    """As Megatron's forward_step (0.19 schedules.py:503, 0.12 :271) wraps the forward, on the CPU."""
    if getattr(config, "enable_autocast", False):
        return torch.autocast("cpu", dtype=config.autocast_dtype or torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _config_with(field: str):
    """Megatron's TransformerConfig, while open, built with ``field`` at its CPU value (a subclass only for the
    constructor: the builders construct it by name)."""
    from megatron.core.transformer import transformer_config

    settings = _settings(field)
    after = {name: settings.pop(name) for name in list(settings) if name in evidence.SET_AFTER_INIT}
    original = transformer_config.TransformerConfig

    class WithField(original):  # build_block's config with the field set (a subclass only for the constructor)
        def __init__(self, **kwargs):
            super().__init__(**{**kwargs, **settings})
            for name, value in after.items():
                setattr(self, name, value)

    WithField.__name__ = WithField.__qualname__ = "TransformerConfig"
    transformer_config.TransformerConfig = WithField
    try:
        yield
    finally:
        transformer_config.TransformerConfig = original


def _block(field: str, moe: bool, micro_batch: int):
    from coc_inject.testbed import models
    from coc_inject.testbed.cpu import cpu_recompute_rng

    cpu_recompute_rng()  # Megatron's checkpoint forks the CUDA RNG: the CPU's for a recompute field
    world = dist.get_world_size()
    sizes = types.SimpleNamespace(layers=2, batch=2, seq=8 * world, heads=2 * world, hidden=8 * world,
                                  ffn=16 * world, moe=moe)
    with _config_with(field):
        block, hidden, mask = models.build_block(sizes, micro_batch=micro_batch)
    return block, hidden.to(block.config.params_dtype), mask  # as the embedding hands it over


def _step(block, hidden, mask) -> dict:
    torch.manual_seed(7)  # dropout draws the same masks in every run
    fused = getattr(block.config, "gradient_accumulation_fusion", False)
    for param in block.parameters():
        param.grad = None
        if fused:  # Megatron's DDP's buffer: the fused kernel adds the weight gradient into it
            param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
    x = hidden.clone().requires_grad_(True)
    with _schedule_context(block.config):
        out = block(x, mask)
    # A fixed random output gradient, not ones: the block ends in its final LayerNorm, whose outputs sum to a
    # constant over the hidden dimension, so ones would send it a zero gradient (rounding noise only) and the
    # last layer's weight gradients would be noise compared with noise (issue 51: the MoE case's layer 1).
    seed = torch.Generator().manual_seed(11 + dist.get_rank())
    out.float().backward(torch.randn(out.shape, generator=seed) / out.numel())
    _tp_replicated_grads_summed(block)
    grads = {name: p.grad.detach().float().clone() for name, p in block.named_parameters() if p.grad is not None}
    if fused:  # a weight's gradient is in main_grad (its .grad a placeholder)
        grads.update({f"{name}.main_grad": p.main_grad.clone() for name, p in block.named_parameters()})
    return {"out": out.detach().float().clone(), "dx": x.grad.detach().float().clone(), **grads}


def _tp_replicated_grads_summed(block) -> None:
    """As Megatron's finalize_model_grads (_allreduce_non_tensor_model_parallel_grads) before the optimizer
    reads them: a parameter every TP rank holds whole under sequence parallelism (norms, row-parallel biases,
    the router) or a q/k layernorm has a gradient summed over the TP ranks (one rank's share alone depends on
    which rows the rank held, which the sequence copies change); one with average_gradients_across_tp_domain
    averaged."""
    from megatron.core import parallel_state

    config, group = block.config, parallel_state.get_tensor_model_parallel_group()
    summed, averaged = [], []
    for name, param in block.named_parameters():
        if param.grad is None:
            continue
        if getattr(param, "average_gradients_across_tp_domain", False):
            averaged.append(param.grad)
        elif (config.sequence_parallel and getattr(param, "sequence_parallel", False)) or (
                getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name)):
            summed.append(param.grad)
    for grads, op in ((summed, dist.ReduceOp.SUM), (averaged, dist.ReduceOp.AVG)):
        if grads:  # one call for all, as Megatron coalesces them
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            dist.all_reduce(flat, op=op, group=group)
            for grad, synced in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(synced.view_as(grad))


def _distance(on: dict, off: dict, where: list | None = None) -> float:
    if set(on) != set(off):
        return float("inf")
    worst = 0.0
    for name, expected in off.items():
        scale = expected.abs().max().item() or 1.0
        distance = (on[name] - expected).abs().max().item() / scale
        if where is not None and distance > 1e-4:
            where.append(name)
        worst = max(worst, distance)
    return worst


def _calls(counts: dict):
    from tests.linears.layer_cases import count_collectives

    return count_collectives(counts)


def _wing_run(block, hidden, mask, off: dict, coc: dict, wing: str) -> dict:
    from coc_inject.config import CocConfig
    from coc_inject.testbed.models import block_variant

    ran, counts = {}, {}
    with block_variant(block, CocConfig(**coc), ran=ran), _calls(counts):
        on = _step(block, hidden, mask)
    where: list = []
    result = {"distance": _distance(on, off, where), "collectives": sum(counts.values()), "where": where[:4]}
    if "copies" in ran:
        result["ran"] = ran["copies"]
    if wing == "moe":
        routes = [m._coc_moe for m in block.modules() if getattr(m, "_coc_moe", None) is not None]
        result["ran"] = (f"{routes[0].pieces} pieces" if routes and routes[0].pieces
                         else f"no pieces: {routes[0].reason if routes else 'no MoE call counted'}")
    return result


def _guarded(function, *args) -> dict:
    try:
        return function(*args)
    except Exception:  # noqa: BLE001 (the test says which field and wing, with the traceback)
        return {"error": traceback.format_exc(limit=6)}


def _hardware_fakes(field: str):
    """gradient_accumulation_fusion: apex's fused_weight_gradient_mlp_cuda, as tests/fakes/fused_wgrad.py
    stands in for it on the CPU (it checks the kernel's call contract)."""
    if field != "gradient_accumulation_fusion":
        return contextlib.nullcontext()
    from tests.fakes import fused_wgrad

    return fused_wgrad.installed()


def _dense_field(field: str) -> dict:
    with _hardware_fakes(field):
        return _dense_field_run(field)


def _dense_field_run(field: str) -> dict:
    """linears (chunks 2), batch copies (2) and sequence copies (2, micro-batch 1) on a dense block."""
    results = {}
    try:
        block, hidden, mask = _block(field, moe=False, micro_batch=2)
        off = _step(block, hidden, mask)
        off_calls: dict = {}
        with _calls(off_calls):
            _step(block, hidden, mask)
        off_count = sum(off_calls.values())
    except Exception:  # noqa: BLE001
        return {"megatron": traceback.format_exc(limit=6)}
    linears = _guarded(_wing_run, block, hidden, mask, off, {"parallel_num": 2}, "linears")
    if "collectives" in linears:  # chunked: more, smaller collectives than Megatron's one per call
        linears["ran"] = ("chunked" if linears["collectives"] > off_count
                          else f"no chunked calls ({linears['collectives']} collectives, Megatron's {off_count})")
    results["linears"] = linears
    results["multi_copy"] = _guarded(_wing_run, block, hidden, mask, off, {"multi_copy": 2}, "multi_copy")
    try:
        block, hidden, mask = _block(field, moe=False, micro_batch=1)
        off = _step(block, hidden, mask)
    except Exception:  # noqa: BLE001
        results["sequence_copies"] = {"megatron": traceback.format_exc(limit=6)}
        return results
    results["sequence_copies"] = _guarded(_wing_run, block, hidden, mask, off, {"multi_copy": 2}, "sequence_copies")
    return results


def dense_fields(fields: list) -> dict:
    from coc_inject.testbed.models import fresh_rng_tracker
    from tests.dist_harness import reinitialize_model_parallel

    reinitialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    fresh_rng_tracker()
    return {field: _dense_field(field) for field in fields}


def _moe_field(field: str) -> dict:
    with _hardware_fakes(field):
        return _moe_field_run(field)


def _moe_field_run(field: str) -> dict:
    """The MoE pieces, the linears (chunks 2) and batch copies (2) on a block of MoE layers (EP 2, TP 2)."""
    try:
        block, hidden, mask = _block(field, moe=True, micro_batch=2)
        off = _step(block, hidden, mask)
    except Exception:  # noqa: BLE001
        return {"megatron": traceback.format_exc(limit=6)}
    linears = _guarded(_wing_run, block, hidden, mask, off, {"parallel_num": 2}, "linears")
    if "collectives" in linears:  # chunked: more collectives than Megatron's (the attention's linears)
        linears["ran"] = "chunked"
    return {"moe": _guarded(_wing_run, block, hidden, mask, off, {"moe_overlap": "1"}, "moe"), "linears": linears,
            "multi_copy": _guarded(_wing_run, block, hidden, mask, off, {"multi_copy": 2}, "multi_copy")}


def moe_fields(fields: list) -> dict:
    from tests.dist_harness import reinitialize_model_parallel
    from tests.moe import moe_cases

    moe_cases.cpu_shims()
    world = dist.get_world_size()
    reinitialize_model_parallel(tensor_model_parallel_size=world, expert_model_parallel_size=world,
                                expert_tensor_parallel_size=1)
    moe_cases._state_key = None  # another module's setup() initialises again
    try:
        return {field: _moe_field(field) for field in fields}
    finally:
        reinitialize_model_parallel(tensor_model_parallel_size=world)


def _pair_field(field: str) -> dict:
    """Megatron's ColumnParallelLinear -> RowParallelLinear (TP 2, SP, fp32 weights), the linears (chunks 2)."""
    from coc_inject.config import CocConfig
    from coc_inject.testbed.models import block_variant
    from tests.linears import layer_cases

    settings = _settings(field)
    torch.manual_seed(3)
    pair = torch.nn.ModuleList([
        layer_cases.build_layer("column", sequence_parallel=True, bias=False, skip_bias_add=False, dtype="float32",
                                hidden=16, ffn=32),
        layer_cases.build_layer("row", sequence_parallel=True, bias=False, skip_bias_add=False, dtype="float32",
                                hidden=16, ffn=32)])
    config = types.SimpleNamespace(**{"enable_autocast": False, "autocast_dtype": None, **settings})
    x = layer_cases.make_input("column", pair[0], sequence_parallel=True, seq=16, batch=2, dtype="float32")

    backward = [True]  # Megatron's backward under CPU autocast (custom_bwd for "cuda") fails: forward only then

    def step():
        for param in pair.parameters():
            param.grad = None
        inputs = x.clone().requires_grad_(backward[0])
        with _schedule_context(config):
            out = pair[1](pair[0](inputs)[0])[0]
        found = {"out": out.detach().float(), "dtype": torch.zeros(0, dtype=out.dtype)}
        if backward[0]:
            out.float().sum().backward()
            found.update(dx=inputs.grad.float(), **{n: p.grad.float() for n, p in pair.named_parameters()})
        return found

    try:
        try:
            off = step()
        except RuntimeError:
            backward[0] = False
            off = step()
    except Exception:  # noqa: BLE001
        return {"megatron": traceback.format_exc(limit=6)}

    def on() -> dict:
        counts: dict = {}
        with block_variant(pair, CocConfig(parallel_num=2)), _calls(counts):
            got = step()
        if got["dtype"].dtype != off["dtype"].dtype:
            raise AssertionError(f"output dtype {got['dtype'].dtype}, Megatron's {off['dtype'].dtype}")
        return {"distance": _distance({k: v for k, v in got.items() if k != "dtype"},
                                      {k: v for k, v in off.items() if k != "dtype"}), "ran": "chunked"}

    return {"linears": _guarded(on)}


def pair_fields(fields: list) -> dict:
    from tests.dist_harness import reinitialize_model_parallel

    reinitialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    return {field: _pair_field(field) for field in fields}


# Rotary embeddings: no learned position table (an fp32 nn.Embedding Megatron-LM's Float16Module casts on a GPU,
# which a bf16 field would meet), and the rope fields are read.
CP_GPT = {"layers": 1, "hidden": 32, "heads": 4, "seq": 32, "vocab": 64, "rope": True}
_ATTENTION_BACKEND_FLAGS = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


def _cp_train(field: str, cp: int, coc) -> dict:
    """One SGD step of tests/context_parallel's tiny GPT (local spec, TP 1) with ``field`` at its CPU value,
    at CP ``cp``; enable_autocast: the step inside CPU autocast, as Megatron's schedule runs it."""
    from tests.context_parallel import cp_gpt_cases

    import os

    sizes = {name: value for name, value in CP_GPT.items() if name not in ("seq", "vocab")}
    for flag in _ATTENTION_BACKEND_FLAGS:  # set by the last model's attention_backend: each run is a new job
        os.environ.pop(flag, None)
    with _config_with(field):
        return cp_gpt_cases.train(1, cp, coc, steps=1, seq=CP_GPT["seq"], vocab=CP_GPT["vocab"],
                                  autocast=field == "enable_autocast", keep_grads=True, **sizes)


CP_ALGORITHMS = ("ring", "allgather")  # the two schedules with a path for every field of the case (GQA included)


def _cp_field(field: str, reference: dict) -> dict:
    found, worst, where = [], 0.0, []
    for algorithm in CP_ALGORITHMS:
        try:
            on = _cp_train(field, 2, {"cp_algo": algorithm})
        except Exception as error:  # noqa: BLE001 (a refusal at CP 2 is an error naming the setting: no Megatron path)
            if type(error).__name__ == "ContextParallelError":
                return {"context_parallel": {"refused": str(error)}}
            return {"context_parallel": {"error": f"{algorithm}: {traceback.format_exc(limit=6)}"}}
        if "megatron" in reference:
            return reference
        found.extend(on["algorithms"] or [f"no CP plan with {algorithm}: Megatron's attention ran"])
        loss = abs(on["losses"][0] - reference["losses"][0]) / (abs(reference["losses"][0]) or 1.0)
        grads = {name: grad.float() for name, grad in on["grads"].items()}
        expected = {name: grad.float() for name, grad in reference["grads"].items()}
        worst = max(worst, loss, _distance(grads, expected, where))
    return {"context_parallel": {"distance": worst, "where": where[:4], "ran": ", ".join(found)}}


def cp_fields(fields: list) -> dict:
    """Context parallelism (COC_CP_ALGO=ring, then allgather, CP 2) against Megatron at CP 1 on the whole sequence, per field:
    the loss and each parameter's gradient of one step, summed over CP as Megatron's DDP does (TP 1: both ranks
    hold the whole model)."""
    from coc_inject.context_parallel import install
    from tests.context_parallel import cp_gpt_cases

    cp_gpt_cases._parallel_state_key = None  # another case's setup initialised the parallel state
    references = {}
    for field in fields:  # Megatron at CP 1 first: one parallel state for all of them
        try:
            references[field] = _cp_train(field, 1, None)
        except Exception:  # noqa: BLE001
            references[field] = {"megatron": traceback.format_exc(limit=6)}
    try:
        return {field: _cp_field(field, references[field]) for field in fields}
    finally:
        install.uninstall()
