"""`make demo`'s MoE part: the same training script with every MLP a mixture of 8 experts (top-4,
alltoall dispatcher), EP 2 on 2 ranks (TP 1, 2 data-parallel replicas), off and with
``COC_MOE_OVERLAP=auto`` through the environment only: over the emulated link where it can be
set up (MOE_MODEL: the experts' compute and their all-to-alls of the same order at 1 gbit), else
over loopback, where auto must not be slower than off beyond the noise. Losses side by side,
median step times, and what each MoE layer ran (COC_REPORT of rank 0, with auto's decisions)."""

import json

import demo_exposure
from demo_runs import variant_runs

MOE_MODEL = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "1",
             "--moe-router-topk", "4", "--num-layers", "2", "--hidden-size", "512", "--ffn-hidden-size", "768",
             "--num-attention-heads", "8", "--seq-length", "512", "--micro-batch-size", "2", "--vocab-size", "256",
             "--overlap-grad-reduce"]
MOE_STEPS = 8
MOE_VARIANTS = {"off": {}, "COC_MOE_OVERLAP=auto": {"COC_MOE_OVERLAP": "auto"}}
LINK_TARGET = 1.15  # issue 26: a GPT-MoE step over the link with auto >= 1.15x off
LOOPBACK_TARGET = 0.97  # and on loopback >= 0.97x off


def moe_part(workdir, link, rate, rounds=1) -> bool:
    where = f"over the emulated {rate} link (one core per rank)" if link else "over loopback"
    title = (f"Part 5: MoE, expert parallelism 2 {where}: tiny GPT with 8 experts per MLP (top-4), the "
             "dispatcher's all-to-alls pipelined against the experts in pieces")
    target = {"COC_MOE_OVERLAP=auto": LINK_TARGET if link else LOOPBACK_TARGET}
    measured = None if link is None else demo_exposure.measuring(workdir, link, MOE_STEPS, MOE_MODEL)
    ok, _ = variant_runs(title, workdir, link, MOE_STEPS, MOE_MODEL, rounds, MOE_VARIANTS, {}, target,
                         show=print_moe_layers, measured=measured)
    return ok


def print_moe_layers(report_path, extra) -> None:
    """Each MoE layer's route (pieces and how many, or Megatron's with the reason) and auto's decisions."""
    report = json.loads(report_path.read_text())
    for layer in report["layers"]:
        if layer["route"] == "moe":
            print(f"   {layer['name']}: " + (f"{layer['pieces']} pieces ({layer['chunks']} per local expert)"
                                             if layer["pieces"] else f"Megatron's dispatcher: {layer['reason']}")
                  + f", {layer['calls']} calls")
    for decision in report.get("moe_decisions", []):
        times = ", ".join(f"{c} {t:.1f} ms" for c, t in decision["times_ms"].items())
        print(f"   auto: {decision['key']} -> {decision['choice']} ({decision['source']}"
              + (f": {times}, max over the EP group)" if times else ")"))
