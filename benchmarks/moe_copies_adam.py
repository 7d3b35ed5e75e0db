"""Why a GPT-MoE run with Adam and ``COC_MULTI_COPY=2`` drifts from the run without copies after a few
steps while an SGD run holds 1e-7 (issue #35): a top-k near-tie that the copies' rounding flips.

    .venv/bin/python benchmarks/moe_copies_adam.py [--steps 6] [--sgd]

benchmarks/moe_copies.py's model (tiny GPT script, 8 experts top-4, Megatron's aux_loss at 1e-2, TP 2 SP x
EP 2 on 2 ranks, Adam), on loopback, three runs: off; ``COC_MULTI_COPY=2``; ``COC_MULTI_COPY=2`` again with
the first token off and the copies route differently given off's experts (its copies' logit of the expert
off left out set 1e-6 under the one off took: nothing else changes). Each rank records every router call's
logits and routing map (the copies' calls joined along the batch in copy order), the gradients Adam steps
with at steps 1 to 3 and Adam's state. Prints per step the losses, the routers' largest logit difference,
every token routed differently (its margin between the k-th and the (k+1)-th logit in off's run, and how
that margin ranks among the call's tokens), the gradients' and Adam's moments' largest relative difference
(per tensor, to its largest element), and the forced run's losses. ``--sgd``: the same with SGD (lr 0.1).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT, FORCE, SGD = "COC_ADAM_PROBE_OUT", "COC_ADAM_PROBE_FORCE", "COC_ADAM_PROBE_SGD"
TOPK = 4


def _rank_probe() -> None:
    """Inside each rank (under torchrun): run the tiny script with the router and the optimizer recorded."""
    import torch
    from megatron.core.transformer.moe import router as router_module
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from coc_inject.multi_copy import scheduler

    rank, step = int(os.environ.get("RANK", "0")), [1]
    record = {"calls": [], "grads": {}, "state": {}}
    force = tuple(map(int, os.environ[FORCE].split(","))) if os.environ.get(FORCE) else None
    routing = router_module.TopKRouter.routing

    def recorded(self, logits, *args, **kwargs):
        copy = scheduler.current_copy()
        if force is not None and (step[0], self.layer_number, copy or 0, rank) == force[:4]:
            s, b, lower, below = force[4:]
            forced = logits.detach().clone()
            forced[s, b, lower] = forced[s, b, below] - 1e-6
            logits = logits + (forced - logits.detach())
        probs, routing_map = routing(self, logits, *args, **kwargs)
        record["calls"].append((step[0], self.layer_number, copy or 0, logits.detach().clone(), routing_map.clone()))
        return probs, routing_map

    def params(optimizer):
        return [p for group in optimizer.param_groups for p in group["params"]]

    def pre(optimizer, args, kwargs):
        if step[0] <= 3:
            record["grads"][step[0]] = [p.grad.clone() for p in params(optimizer) if p.grad is not None]

    def post(optimizer, args, kwargs):
        if step[0] <= 3:
            record["state"][step[0]] = [{k: v.clone() for k, v in optimizer.state[p].items() if k != "step"}
                                        for p in params(optimizer) if optimizer.state.get(p)]
        step[0] += 1

    router_module.TopKRouter.routing = recorded
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)
    if os.environ.get(SGD):
        torch.optim.Adam = lambda parameters, lr: torch.optim.SGD(parameters, lr=0.1)
    sys.argv[0] = str(ROOT / "examples" / "pretrain_tiny_gpt.py")
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        torch.save(record, f"{os.environ[OUT]}.rank{rank}.pt")


def _joined(record) -> dict:
    """(step, layer) -> (logits [s, b, E], routing map [s, b, E]): the copies' calls joined in copy order."""
    import torch

    calls = {}
    for step, layer, copy, logits, routing_map in record["calls"]:
        calls.setdefault((step, layer), []).append((copy, logits, routing_map.view(*logits.shape)))
    return {key: tuple(torch.cat([part[i] for part in sorted(parts, key=lambda p: p[0])], dim=1) for i in (1, 2))
            for key, parts in calls.items()}


def _relative(found, truth) -> float:
    return max(((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item() for a, b in zip(truth, found))


def compare(off, copies, rank) -> tuple | None:
    """Print the routers' and the optimizer's differences per step; the first flipped token as a force."""
    first, joined = None, _joined(copies)
    for (step, layer), (logits, routing_map) in sorted(_joined(off).items()):
        other_logits, other_map = joined[(step, layer)]
        experts = logits.shape[-1]
        ranked = logits.reshape(-1, experts).sort(dim=-1, descending=True).values
        margins = ranked[:, TOPK - 1] - ranked[:, TOPK]
        flipped = (routing_map != other_map).any(-1).reshape(-1).nonzero().view(-1).tolist()
        print(f"  rank {rank} step {step} layer {layer}: logits max |diff| {(logits - other_logits).abs().max():.2e}, "
              f"smallest margin {margins.min():.2e}, tokens routed differently {len(flipped)}")
        for token in flipped:
            s, b = divmod(token, logits.shape[1])
            took = set(routing_map.reshape(-1, experts)[token].nonzero().view(-1).tolist())
            other = set(other_map.reshape(-1, experts)[token].nonzero().view(-1).tolist())
            (left,), (instead,) = sorted(took - other), sorted(other - took)
            print(f"    token (s {s}, b {b}): off took expert {left}, copies {instead}; off's margin "
                  f"{margins[token]:.2e} (the call's {int((margins < margins[token]).sum()) + 1}. smallest of "
                  f"{margins.numel()}), |logit diff| of the two {(logits[s, b] - other_logits[s, b]).abs().max():.2e}")
            half = logits.shape[1] // 2
            first = first or (step, layer, b // half, rank, s, b % half, instead, left)
    for step in sorted(off["grads"]):
        moments = {key: _relative([m[key] for m in copies["state"][step]], [m[key] for m in off["state"][step]])
                   for key in ("exp_avg", "exp_avg_sq", "momentum_buffer") if key in (off["state"][step] or [{}])[0]}
        print(f"  rank {rank} step {step}: gradients max relative diff {_relative(copies['grads'][step], off['grads'][step]):.1e}"
              + "".join(f", {key} {value:.1e}" for key, value in moments.items()))
    return first


def main(argv=None) -> int:
    if os.environ.get(OUT):
        _rank_probe()
        return 0
    import torch

    sys.path[:0] = [str(ROOT / "examples"), str(ROOT / "benchmarks")]
    from launch import SITE, clean_env, torchrun
    from moe_copies import MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sgd", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        def run(name, **env):
            env = clean_env(PYTHONPATH=str(SITE), **{OUT: f"{workdir}/{name}", **({SGD: "1"} if args.sgd else {}), **env})
            proc = torchrun(Path(__file__).resolve(), ["--steps", str(args.steps), *MODEL], env, workdir)
            if proc.returncode:
                raise SystemExit(f"{name} failed:\n{proc.stderr[-4000:]}")
            losses = [float(line.split("loss ")[1].split()[0]) for line in proc.stdout.splitlines()
                      if line.startswith("step")]
            return losses, [torch.load(f"{workdir}/{name}.rank{r}.pt") for r in range(2)]

        off, off_records = run("off")
        copies, copies_records = run("copies", COC_MULTI_COPY="2")
        print("loss |diff| per step:", " ".join(f"{abs(a - b):.1e}" for a, b in zip(off, copies)))
        firsts = [compare(o, c, rank) for rank, (o, c) in enumerate(zip(off_records, copies_records))]
        firsts = sorted(f for f in firsts if f is not None)
        if not firsts:
            print("no token routed differently")
            return 0
        force = firsts[0]
        forced, _ = run("forced", COC_MULTI_COPY="2", **{FORCE: ",".join(map(str, force))})
        print(f"copies with off's experts for step {force[0]} layer {force[1]} rank {force[3]} copy {force[2]}'s "
              f"token (s {force[4]}, b {force[5]}): loss |diff| per step:",
              " ".join(f"{abs(a - b):.1e}" for a, b in zip(off, forced)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
