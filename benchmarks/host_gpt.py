"""What coc-inject costs the host on a whole GPT training step (issue 52): off (no bootstrap) against each
wing on and every wing ``auto``, each run its own process.

    python benchmarks/host_gpt.py --device cuda                      # the launch-bound step on one GPU
    python benchmarks/host_gpt.py --device cpu --calls               # Python calls per step on this CPU
    python benchmarks/host_gpt.py --device cpu --calls --tp 2        # the same at TP 2 (two gloo ranks)

The model: megatron-core's GPTModel with its local layer spec, Adam, ``--layers`` x ``--hidden`` at
``--seq`` (bf16 on a GPU, fp32 on the CPU), micro-batch ``--batch``; world size ``--tp`` (tensor-parallel,
sequence parallel at TP > 1). Runs alternate (off, then every variant) over ``--rounds``. Each run reports
its first step's time, the median of its later steps, and its losses (which must equal off's). ``--calls``:
the run also counts the Python calls of its steps with cProfile (every function call, builtins too),
``--steps`` steps minus ``--steps // 2`` steps, per step: setup and the first step's one-off work cancel
out (the way issue 52 counted them). A run's trial lines (``auto``'s decisions) are kept.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "off": None,
    "linears auto": {"COC_PARALLEL_NUM": "auto"},
    "copies auto": {"COC_MULTI_COPY": "auto"},
    "moe auto": {"COC_MOE_OVERLAP": "auto"},
    "cp auto": {"COC_CP_ALGO": "auto"},
    "every wing auto": {"COC_PARALLEL_NUM": "auto", "COC_MULTI_COPY": "auto", "COC_MOE_OVERLAP": "auto",
                        "COC_CP_ALGO": "auto"},
}
LOSS_BOUND = {"cpu": 1e-5, "cuda": 1e-2}  # relative: fp32 on the CPU; bf16's order of reductions on a GPU


def _steps(args, step, count: int) -> tuple:
    from coc_inject import timer  # a plain module: nothing of coc-inject is installed by it (the off run)

    losses, times = [], []
    for _ in range(count):
        loss, elapsed = timer.seconds(step, args.device_obj)
        times.append(elapsed)
        losses.append(loss.item())
    return losses, times


def train(args) -> dict:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", 0)
    else:
        torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's rope / SP buffers: the CPU here
        torch.set_num_threads(1)
    args.device_obj = device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(world, 1)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        tp_random.model_parallel_cuda_manual_seed(args.seed)
    else:  # no CUDA generator to fork: Megatron's no-op tracker (dropout is 0)
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = get_gpt_layer_local_spec()
    if device.type == "cpu":  # apex's FusedLayerNorm is CUDA's: the test bed's CPU norm with SP's flags
        from coc_inject.testbed.cpu import CpuLayerNorm

        from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

        spec.submodules.input_layernorm = CpuLayerNorm
        spec.submodules.pre_mlp_layernorm = CpuLayerNorm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * args.layers, layer_norm=CpuLayerNorm)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                               ffn_hidden_size=4 * args.hidden, bf16=dtype == torch.bfloat16, params_dtype=dtype,
                               hidden_dropout=0.0, attention_dropout=0.0, masked_softmax_fusion=False,
                               bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                               gradient_accumulation_fusion=False, use_cpu_initialization=True, pipeline_dtype=dtype,
                               tensor_model_parallel_size=world, sequence_parallel=world > 1)
    model = GPTModel(config, transformer_layer_spec=spec, vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope")
    if dtype == torch.bfloat16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    positions = torch.arange(args.seq, device=device).unsqueeze(0).expand(args.batch, args.seq)
    mask = torch.triu(torch.ones(1, 1, args.seq, args.seq, dtype=torch.bool, device=device), diagonal=1)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        if world > 1:  # the sequence-parallel norms' gradients, as Megatron's finalize_model_grads sums them
            for param in model.parameters():
                if getattr(param, "sequence_parallel", False) and param.grad is not None:
                    dist.all_reduce(param.grad)
        optimizer.step()
        return loss

    losses, times = _steps(args, step, args.steps)
    result = {"losses": losses, "step_times": times}
    if args.calls:  # Python calls per step: a long window minus a short one (cProfile's every call)
        counted = []
        for count in (args.steps, args.steps // 2):
            profile = cProfile.Profile()
            profile.enable()
            _steps(args, step, count)
            profile.disable()
            counted.append(sum(row[1] for row in pstats.Stats(profile).stats.values()))  # ncalls, recursion in
        result["calls_per_step"] = (counted[0] - counted[1]) / (args.steps - args.steps // 2)
    dist.destroy_process_group()
    return result if rank == 0 else {}


def launch(args, name: str) -> dict:
    settings = VARIANTS[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC"))}
    site = str(ROOT / "sitecustomize")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(site).resolve()]
    env["PYTHONPATH"] = os.pathsep.join(([site] if settings else []) + paths + [str(ROOT)])
    env.update(settings or {})
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), WORLD_SIZE=str(args.tp))
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--child", out.name, "--device", args.device, "--steps", str(args.steps),
                   "--batch", str(args.batch), "--layers", str(args.layers), "--heads", str(args.heads),
                   "--vocab", str(args.vocab), "--seq", str(args.seq), "--hidden", str(args.hidden),
                   "--tp", str(args.tp)] + (["--calls"] if args.calls else [])
        procs = [subprocess.Popen(command, env=dict(env, RANK=str(rank)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in range(args.tp)]
        outputs = [proc.communicate() for proc in procs]
        if any(proc.returncode for proc in procs):
            raise SystemExit(f"{name} run failed:\n" + "\n".join(err[-4000:] for _, err in outputs))
        result = json.loads(Path(out.name).read_text())
    stderr = outputs[0][1].splitlines()
    result["trials"] = [line for line in stderr if "auto:" in line and "trials" in line]
    result["banner"] = [line for line in stderr if "installed" in line][:4]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--variants", default="off,every wing auto",
                        help=f"comma-separated, of: {', '.join(VARIANTS)} (off always runs)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=1, help="world size = tensor-parallel size (SP at TP > 1)")
    parser.add_argument("--calls", action="store_true", help="count the Python calls per step (cProfile)")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29563, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = train(args)
        if int(os.environ.get("RANK", 0)) == 0:
            Path(args.child).write_text(json.dumps(result))
        return 0
    names = ["off"] + [name for name in args.variants.split(",") if name and name != "off"]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)}")
    runs = {name: [] for name in names}
    for round_ in range(args.rounds):
        for name in names:
            runs[name].append(launch(args, name))
            print(f"round {round_ + 1} {name}: first step {runs[name][-1]['step_times'][0] * 1e3:.1f} ms", flush=True)
    skip = min(2, args.steps - 1)
    rows, apart = {}, []
    for name, results in runs.items():
        steady = 1e3 * statistics.median(t for r in results for t in r["step_times"][skip:])
        first = 1e3 * statistics.median(r["step_times"][0] for r in results)
        row = {"first_ms": first, "steady_ms": steady, "trials": results[0]["trials"], "banner": results[0]["banner"]}
        if args.calls:
            row["calls_per_step"] = statistics.median(r["calls_per_step"] for r in results)
        loss_diff = max(abs(a - b) / abs(b) for r, o in zip(results, runs["off"]) for a, b in zip(r["losses"], o["losses"]))
        row["max_rel_loss_diff"] = loss_diff
        if not loss_diff <= LOSS_BOUND[args.device.split(":")[0]]:
            apart.append(name)
        rows[name] = row
    off = rows["off"]
    print(f"GPT {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, TP {args.tp}, "
          f"{args.device}; {args.rounds} rounds x {args.steps} steps, interleaved")
    for name, row in rows.items():
        calls = (f", {row['calls_per_step']:.0f} Python calls a step ({row['calls_per_step'] / off['calls_per_step']:.3f}x)"
                 if args.calls else "")
        print(f"  {name:>16}: first step {row['first_ms']:.1f} ms ({(row['first_ms'] - off['first_ms']) / 1e3:+.2f} s), "
              f"steady {row['steady_ms']:.2f} ms ({off['steady_ms'] / row['steady_ms']:.3f}x off's speed){calls}; "
              f"{len(row['trials'])} trial lines; max rel loss diff {row['max_rel_loss_diff']:.1e}")
        for line in row["trials"][:3]:
            print(f"      {line[:200]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "args": {k: v for k, v in vars(args).items()
                                                                             if k != "device_obj"}, "rows": rows},
                                              indent=1))
    if apart:
        print(f"FAIL: losses differ from off's beyond {LOSS_BOUND}: {apart}")
    return 1 if apart else 0


if __name__ == "__main__":
    sys.exit(main())
