"""The models the lab runs, each as parts at one rank's shapes (BRIEF section 14's figures): heads and
FFN divided by TP, experts by EP, the sequence by CP and by TP under sequence parallelism, a few layers
each; ``depth`` the model's layer count, which the per-step figures are scaled to. Dense parts run at
micro-batch 2: at 1, multi-copy cuts the sequence, whose all-to-all re-layout under sequence parallelism
the lab's outputs cannot make consistent (its all-to-all stops with an error naming the splits)."""

from __future__ import annotations

from dataclasses import dataclass

WINGS = ("linears", "context_parallel", "multi_copy", "moe")


@dataclass(frozen=True)
class Part:
    name: str
    tp: int
    hidden: int
    heads: int
    ffn: int
    seq: int  # the whole sequence (all CP and TP ranks together)
    cp: int = 1
    ep: int = 1
    groups: int | None = None  # key/value heads (GQA)
    batch: int = 1
    layers: int = 2
    depth: int = 2  # the model's layers: per-step figures x depth / layers
    experts: int = 0
    topk: int = 2

    @property
    def wings(self) -> tuple:
        return tuple(wing for wing, applies in zip(WINGS, (self.tp > 1, self.cp > 1, True, self.experts > 0)) if applies)


def _llama8b(name, tp, seq=8192, batch=2, cp=1, layers=2):
    return Part(name, tp, 4096, 32, 14336, seq, cp=cp, groups=8, batch=batch, layers=layers, depth=32)


def _mixtral(name, tp):
    return Part(name, tp, 4096, 32, 14336, 4096, ep=8, groups=8, layers=1, depth=32, experts=8, topk=2)


MODELS = {
    "tiny": (Part("tiny dense TP2 CP2", 2, 64, 4, 256, 64, cp=2, batch=2),
             Part("tiny MoE TP2 EP2", 2, 64, 4, 128, 64, ep=2, batch=2, experts=4, topk=2)),
    "demo": (Part("make demo's link model TP2 SP (block)", 2, 512, 8, 512, 256, batch=16),),
    "llama3-8b": tuple(_llama8b(f"Llama-3-8B TP{tp} SP", tp) for tp in (2, 4, 8)),
    "llama3-70b": (Part("Llama-3-70B TP8 SP", 8, 8192, 64, 28672, 8192, groups=8, batch=2, layers=1, depth=80),),
    "mixtral-8x7b": (_mixtral("Mixtral-8x7B EP8", 1), _mixtral("Mixtral-8x7B TP2 SP EP8", 2)),
    "qwen3-30b-a3b": (Part("Qwen3-30B-A3B-like EP8 (128 experts top-8)", 1, 2048, 32, 768, 4096, ep=8, groups=4,
                           layers=1, depth=48, experts=128, topk=8),),
    "llama3-8b-cp": (_llama8b("Llama-3-8B CP4 seq 32k", 1, seq=32768, cp=4, layers=1),),
}


def model(name: str) -> tuple:
    if name not in MODELS:
        raise ValueError(f"--model {name!r}: one of {', '.join(MODELS)}")
    return MODELS[name]
