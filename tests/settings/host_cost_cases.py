"""Worker functions for tests/settings/test_host_cost.py (one gloo rank): what a wing decides once is kept on
the layer keyed by what it read and dropped by uninstall(); at TP 1 every wing on auto runs no trial and adds
(almost) no Python calls to a GPT training step."""

from __future__ import annotations

import cProfile
import pstats

import torch

from coc_inject.settings.parsers import AUTO

EVERY_WING_AUTO = {"parallel_num": AUTO, "multi_copy": AUTO, "moe_overlap": "auto", "cp_algo": "auto"}


def install_every_wing(coc: dict) -> None:
    """Every wing ``coc`` arms, into one installation (as the import hooks do)."""
    from coc_inject.config import CocConfig
    from coc_inject.testbed.models import install_every_wing as install

    install(CocConfig(**coc))


def verdict_attributes(module) -> list:
    """coc-inject's attributes on ``module`` and its sub-modules but the last routes (records, not verdicts)."""
    return sorted({f"{name}.{attribute}" for name, part in module.named_modules() for attribute in vars(part)
                   if attribute.startswith("_coc") and attribute not in ("_coc_moe", "_coc_cp")})


def moe_verdict_follows_its_config() -> dict:
    """An MoE layer's reason, kept on the layer: a config change in place, and a re-install after uninstall
    with another setting, each decide afresh; uninstall leaves no verdict on the layer."""
    from coc_inject import job
    from tests.moe.moe_cases import build_layer, route_of, setup

    setup(1, coc=None)
    layer = build_layer(experts=2, ep=1)
    x = torch.randn(8, 1, 16)
    result = {}
    setup(1, coc={"moe_overlap": "1"})
    layer(x)
    result["first"] = route_of(layer)
    job.uninstall()
    result["left after uninstall"] = verdict_attributes(layer)
    layer.config.moe_enable_deepep = True  # refused by the pieces; the alltoall dispatcher built never reads it
    setup(1, coc={"moe_overlap": "1"})
    layer(x)
    result["re-installed, refused setting"] = route_of(layer)
    layer.config.moe_enable_deepep = False  # changed in place: the verdict read it
    layer(x)
    result["setting put back"] = route_of(layer)
    job.uninstall()
    return result


def _gpt(layers: int = 2, hidden: int = 32, seq: int = 16, vocab: int = 64):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from coc_inject.testbed.cpu import CpuLayerNorm
    from coc_inject.testbed.models import fresh_rng_tracker

    fresh_rng_tracker()
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec()
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = CpuLayerNorm
    config = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, ffn_hidden_size=2 * hidden,
                               hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               gradient_accumulation_fusion=False, use_cpu_initialization=True)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                     position_embedding_type="rope")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).unsqueeze(0).expand(2, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        return loss.item()

    return model, step


def _calls(step, steps: int) -> int:
    """Every call cProfile sees (functions and builtins) over ``steps`` steps."""
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        step()
    profile.disable()
    return sum(row[1] for row in pstats.Stats(profile).stats.values())


def every_wing_auto_at_tp1(steps: int = 4) -> dict:
    """Python calls per step off, then with every wing on auto (after its first step); the trials run, the
    copies' route and the verdicts left after uninstall."""
    from coc_inject import job, trial
    from coc_inject.multi_copy import forward as copies_forward

    job.uninstall()
    model, step = _gpt()
    step(), step()
    off = _calls(step, steps) / steps
    install_every_wing(EVERY_WING_AUTO)
    trials_before = trial.entered()
    step(), step()  # the first: every decision made there
    on = _calls(step, steps) / steps
    installation = job.current()
    block = model.decoder
    result = {"off": off, "on": on, "trials": trial.entered() - trials_before,
              "decisions": {wing: len(tuner.decisions) for wing, tuner in installation.tuners.items()},
              "copies route": getattr(copies_forward.last_route(block), "reason", None)}
    job.uninstall()
    result["left after uninstall"] = verdict_attributes(model)
    return result
