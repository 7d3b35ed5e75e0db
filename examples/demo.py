"""`make demo`: the main job. An unmodified tiny Megatron-core GPT pretraining script
(examples/pretrain_tiny_gpt.py: TP=2, sequence parallel, CPU + gloo) runs twice under torchrun:
CoC off, then CoC on through environment variables only. Prints the banner, the step losses side
by side (equal within 1e-5) and the step times.

    python examples/demo.py [--steps 30] [--chunks 4] [--link 1gbit]

``--link RATE`` (root) runs the two ranks as two single-rank "nodes" in network namespaces
joined by a rate-limited link (coc_inject.bench.link) to show the step-time gain CoC gives when
the interconnect, not the CPU, is the bottleneck. It then uses a larger model by default
(LINK_MODEL below: 4096 rows per step, so each collective moves megabytes and gloo's ~0.5 ms
per-collective latency stays small next to it) with 8 chunks and 6 steps.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from launch import ROOT, clean_env, coc_env, torchrun

sys.path.insert(0, str(ROOT))
SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
LOSS_BOUND = 1e-5
# Model for --link: per-call compute and communication of the same order at 1 gbit on one core.
LINK_MODEL = ["--seq-length", "256", "--micro-batch-size", "16", "--hidden-size", "512",
              "--ffn-hidden-size", "512", "--num-attention-heads", "8"]


def run(label, env, workdir, steps, link, extra_args):
    print(f"== {label}", flush=True)
    out = Path(workdir) / f"{label.split()[1]}.json"
    proc = torchrun(SCRIPT, ["--steps", str(steps), "--json", str(out), *extra_args], env, workdir, link)
    if proc.returncode != 0:
        print(proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"demo: the {label} run failed (exit {proc.returncode})")
    for line in proc.stderr.splitlines():
        if line.startswith("[coc-inject"):
            print("  ", line)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, help="training steps (default 30; 6 with --link)")
    parser.add_argument("--chunks", type=int, help="COC_PARALLEL_NUM of the CoC run (default 4; 8 with --link)")
    parser.add_argument("--link", metavar="RATE", help="emulate this link rate between the ranks (root)")
    parser.add_argument("script_args", nargs="*", help="extra arguments for the training script")
    args = parser.parse_args(argv)
    args.steps = args.steps or (6 if args.link else 30)
    args.chunks = args.chunks or (8 if args.link else 4)
    if args.link and not args.script_args:
        args.script_args = LINK_MODEL

    link_context = contextlib.nullcontext()
    if args.link:
        from coc_inject.bench.link import EmulatedLink, LinkError

        try:
            EmulatedLink.check_available()
        except LinkError as error:
            raise SystemExit(f"demo: {error}") from None
        link_context = EmulatedLink(args.link)
    with tempfile.TemporaryDirectory() as workdir, link_context as link:
        where = f"emulated {args.link} link" if args.link else "loopback"
        off = run(f"CoC off: torchrun, 2 ranks, {where}", clean_env(), workdir, args.steps, link, args.script_args)
        on = run(f"CoC on: COC_PARALLEL_NUM={args.chunks}, same command", coc_env(args.chunks), workdir,
                 args.steps, link, args.script_args)

    print(f"\n{'step':>4}  {'loss, CoC off':>16}  {'loss, CoC on':>16}  {'|diff|':>9}  {'ms off':>8}  {'ms on':>8}")
    worst = 0.0
    for step, (a, b, ta, tb) in enumerate(zip(off["losses"], on["losses"], off["step_times"], on["step_times"])):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:16.9f}  {b:16.9f}  {abs(a - b):9.2e}  {1e3 * ta:8.1f}  {1e3 * tb:8.1f}")
    # Step 0 includes warm-up; compare the steady state.
    median_off = statistics.median(off["step_times"][1:])
    median_on = statistics.median(on["step_times"][1:])
    ratios = statistics.median(a / b for a, b in zip(off["step_times"][1:], on["step_times"][1:]))
    print(f"\nmedian step time (steps 1..{args.steps - 1}): CoC off {1e3 * median_off:.1f} ms, "
          f"CoC on {1e3 * median_on:.1f} ms; median per-step ratio off/on {ratios:.3f}")
    equal = worst <= LOSS_BOUND
    print(f"losses {'EQUAL' if equal else 'DIFFERENT'} within {LOSS_BOUND:g} (max |diff| {worst:.2e})")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
