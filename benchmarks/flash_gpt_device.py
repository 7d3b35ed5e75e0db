"""`COC_FLASH_ATTN=1` on a whole Megatron GPT training step on one device, against Megatron's own local
attention (what a `--transformer-impl local` job runs instead): losses and step times.

    python benchmarks/flash_gpt_device.py [--shapes 2048x1024,4096x1024] [--rounds 2] [--steps 8]

Each run is its own process: megatron-core's GPTModel with its local layer spec (`get_gpt_layer_local_spec`),
bf16 weights and activations, Adam, world size 1; the CoC run has the bootstrap on PYTHONPATH and
`COC_FLASH_ATTN=1` (the device's fused flash kernel in place of Megatron's `[b, heads, s, s]` softmax
attention), the off run has neither. Runs alternate (off, flash, off, flash, ...) over ROUNDS; the step time
is the median after the first two steps, the peak memory the allocator's. Megatron's fused softmax,
rope and bias fusions are off (they need apex or TE, not installed there). `--device cpu --shapes
256x64 --steps 3 --rounds 1` is the dry run on this repository's CPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOSS_BOUND = 1e-2  # absolute, on losses near 10: bf16's rounding of two attention computations (seen <= 2.6e-3)


def train(args) -> dict:
    """One run in this process: ``args.steps`` steps of the model, its losses, step times and peak memory."""
    import torch
    import torch.distributed as dist

    from coc_inject import timer  # a plain module: nothing of coc-inject is installed by it (the off run)

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    if device.type == "cpu":
        torch.cuda.current_device = lambda: torch.device("cpu")  # Megatron's rope buffers: the CPU here
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        tp_random.model_parallel_cuda_manual_seed(args.seed)
    else:  # no CUDA generator to fork: Megatron's no-op tracker (dropout is 0)
        tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    seq, hidden = args.seq, args.hidden
    dtype = torch.bfloat16
    config = TransformerConfig(num_layers=args.layers, hidden_size=hidden, num_attention_heads=args.heads,
                               ffn_hidden_size=4 * hidden, bf16=True, params_dtype=dtype, hidden_dropout=0.0,
                               attention_dropout=0.0, masked_softmax_fusion=False, bias_activation_fusion=False,
                               bias_dropout_fusion=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
                               use_cpu_initialization=True, pipeline_dtype=dtype)
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=args.vocab,
                     max_sequence_length=seq, position_embedding_type="rope")
    from megatron.core.transformer.module import Float16Module

    model = Float16Module(config, model).to(device)  # as Megatron-LM wraps a bf16 model: inputs and outputs cast
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(0, args.vocab, (args.batch, seq + 1), generator=generator).to(device)
    positions = torch.arange(seq, device=device).unsqueeze(0).expand(args.batch, seq)
    mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device), diagonal=1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        optimizer.step()
        return loss

    losses, times = [], []
    for _ in range(args.steps):
        loss, elapsed = timer.seconds(step, device)  # the device synchronised before and after
        times.append(elapsed)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    dist.destroy_process_group()
    return {"losses": losses, "step_times": times, "peak_gib": peak}


def launch(args, shape, flash: bool) -> dict:
    seq, hidden = shape
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC"))}
    site = str(ROOT / "sitecustomize")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != Path(site).resolve()]
    env["PYTHONPATH"] = os.pathsep.join(([site] if flash else []) + paths + [str(ROOT)])
    if flash:
        env["COC_FLASH_ATTN"] = "1"
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, __file__, "--child", out.name, "--seq", str(seq), "--hidden", str(hidden),
                   "--device", args.device, "--steps", str(args.steps), "--batch", str(args.batch),
                   "--layers", str(args.layers), "--heads", str(args.heads), "--vocab", str(args.vocab)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{'flash' if flash else 'off'} run of {seq}x{hidden} failed:\n{proc.stderr[-4000:]}")
        banner = [line for line in proc.stderr.splitlines() if "coc-inject" in line and "attention" in line]
        result = json.loads(Path(out.name).read_text())
    result["banner"] = banner[:2]
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="2048x1024,4096x1024", help="seq x hidden, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1234, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29561, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        Path(args.child).write_text(json.dumps(train(args)))
        return 0
    rows = []
    for text in args.shapes.split(","):
        shape = tuple(int(x) for x in text.split("x"))
        runs = {"off": [], "flash": []}
        for _ in range(args.rounds):
            for name in ("off", "flash"):
                runs[name].append(launch(args, shape, name == "flash"))
        skip = min(2, args.steps - 1)
        median = {n: 1e3 * statistics.median(t for r in rs for t in r["step_times"][skip:]) for n, rs in runs.items()}
        diff = max(abs(a - b) for off, fl in zip(runs["off"], runs["flash"]) for a, b in zip(off["losses"], fl["losses"]))
        row = {"seq": shape[0], "hidden": shape[1], "off_ms": median["off"], "flash_ms": median["flash"],
               "speedup": median["off"] / median["flash"], "max_loss_diff": diff,
               "first_losses": [runs["off"][0]["losses"][:3], runs["flash"][0]["losses"][:3]],
               "peak_gib": [runs["off"][0]["peak_gib"], runs["flash"][0]["peak_gib"]],
               "banner": runs["flash"][0]["banner"]}
        rows.append(row)
        print(f"seq {shape[0]} hidden {shape[1]} (batch {args.batch}, {args.layers} layers, {args.heads} heads, bf16): "
              f"Megatron's local attention {median['off']:.1f} ms, COC_FLASH_ATTN=1 {median['flash']:.1f} ms "
              f"({row['speedup']:.2f}x); peak GiB {row['peak_gib']}; max |loss diff| {diff:.2e}; "
              f"losses {row['first_losses']}; {row['banner']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))
    apart = [f"seq {r['seq']}: {r['max_loss_diff']:.2e}" for r in rows if not r["max_loss_diff"] <= LOSS_BOUND]
    if apart:  # a wrong attention must not be recorded as a speed-up
        print(f"FAIL: the losses differ by more than {LOSS_BOUND} ({', '.join(apart)})")
    return 1 if apart else 0


if __name__ == "__main__":
    sys.exit(main())
