"""`make demo`: the main job. An unmodified tiny Megatron-core GPT pretraining script
(examples/pretrain_tiny_gpt.py: TP=2, sequence parallel, CPU + gloo) runs under torchrun with
CoC off, then with ``COC_PARALLEL_NUM=auto`` through environment variables only. Prints the
coc-inject lines (banner, each shape's auto decision, the first-step summary), the step losses
side by side (equal within 1e-5), the step times, and each shape's chosen chunk count.

Part 1 runs over loopback, where the two ranks share two cores and overlap cannot pay: auto
should find that out and step aside (Megatron's own path). Part 2, where an emulated link can
be set up (root, `ip` and `tc`), runs the same comparison with the two ranks as two single-rank
"nodes" in network namespaces joined by a rate-limited link (coc_inject.bench.link), with a model
sized so communication matters (LINK_MODEL: 4096 rows per step); otherwise one line says why it
is skipped.

    python examples/demo.py [--steps 30] [--link-rate 1gbit] [--no-link] [--chunks N]

``--chunks N`` compares a fixed chunk count instead of auto.
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from launch import ROOT, SITE, clean_env, torchrun

sys.path.insert(0, str(ROOT))
SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
LOSS_BOUND = 1e-5
# Model for the link part: per-call compute and communication of the same order at 1 gbit on one core.
LINK_MODEL = ["--seq-length", "256", "--micro-batch-size", "16", "--hidden-size", "512",
              "--ffn-hidden-size", "512", "--num-attention-heads", "8"]
LINK_STEPS = 10


def run(label, env, workdir, steps, link, extra_args):
    print(f"== {label}", flush=True)
    out = Path(workdir) / f"{label.split()[1].rstrip(':')}.json"
    proc = torchrun(SCRIPT, ["--steps", str(steps), "--json", str(out), *extra_args], env, workdir, link)
    if proc.returncode != 0:
        print(proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"demo: the {label} run failed (exit {proc.returncode})")
    for line in proc.stderr.splitlines():
        if line.startswith("[coc-inject rank 0"):
            print("  ", line)
    return json.loads(out.read_text())


def coc_environment(chunks, workdir):
    """CoC through the environment only; a fresh tune cache so the trials show."""
    return clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM=chunks, COC_TUNE_CACHE=str(Path(workdir) / "tune.json"),
                     COC_REPORT=str(Path(workdir) / "coc-report-{rank}.json"))


def compare(title, workdir, steps, link, script_args, chunks) -> bool:
    print(f"\n### {title}", flush=True)
    off = run("CoC off: torchrun, 2 ranks", clean_env(), workdir, steps, link, script_args)
    on = run(f"CoC on: COC_PARALLEL_NUM={chunks}, same command", coc_environment(chunks, workdir), workdir,
             steps, link, script_args)
    print(f"\n{'step':>4}  {'loss, CoC off':>16}  {'loss, CoC on':>16}  {'|diff|':>9}  {'ms off':>8}  {'ms on':>8}")
    worst = 0.0
    for step, (a, b, ta, tb) in enumerate(zip(off["losses"], on["losses"], off["step_times"], on["step_times"])):
        worst = max(worst, abs(a - b))
        print(f"{step:>4}  {a:16.9f}  {b:16.9f}  {abs(a - b):9.2e}  {1e3 * ta:8.1f}  {1e3 * tb:8.1f}")
    report = json.loads((Path(workdir) / "coc-report-0.json").read_text())
    print_decisions(report)
    # Step 0 includes warm-up (and auto's trials); compare the steady state.
    median_off = statistics.median(off["step_times"][1:])
    median_on = statistics.median(on["step_times"][1:])
    ratio = statistics.median(a / b for a, b in zip(off["step_times"][1:], on["step_times"][1:]))
    print(f"\nmedian step time (steps 1..{steps - 1}): CoC off {1e3 * median_off:.1f} ms, "
          f"CoC on {1e3 * median_on:.1f} ms; median per-step ratio off/on {ratio:.3f} "
          f"(step 0, with auto's trials: {1e3 * off['step_times'][0]:.0f} ms off, {1e3 * on['step_times'][0]:.0f} ms on)")
    equal = worst <= LOSS_BOUND
    print(f"losses {'EQUAL' if equal else 'DIFFERENT'} within {LOSS_BOUND:g} (max |diff| {worst:.2e})")
    return equal


def print_decisions(report) -> None:
    """Each shape's chunk count: auto's decisions, else the layers' routes."""
    decisions = report.get("auto_decisions") or []
    if decisions:
        print(f"\n{'auto decision (rank 0)':<44}  {'N':>3}  candidates, ms (fwd+bwd, max over ranks)")
        for d in decisions:
            times = ", ".join(f"N={c}: {t:.1f}" for c, t in sorted(d["times_ms"].items(), key=lambda kv: int(kv[0])))
            shape = f"{d['case']} [{', '.join(map(str, d['shape']))}] {d['dtype']}"
            print(f"{shape:<44}  {d['chunks']:>3}  {times or d['source']}")
    routes = {}
    for layer in report["layers"]:
        route = layer["route"] if layer["route"] != "chunked" else f"chunked N={layer['chunks']}"
        routes[route] = routes.get(route, 0) + layer["calls"]
    print("layer calls by route: " + ", ".join(f"{route} {calls}" for route, calls in sorted(routes.items())))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="loopback training steps (default 30)")
    parser.add_argument("--chunks", default="auto", help="COC_PARALLEL_NUM of the CoC runs (default auto)")
    parser.add_argument("--link-rate", default="1gbit", help="rate of the emulated link (default 1gbit)")
    parser.add_argument("--no-link", action="store_true", help="skip the emulated-link part")
    parser.add_argument("script_args", nargs="*", help="extra arguments for the training script")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as workdir:
        ok = compare("Part 1: loopback (two ranks on this machine's cores)", workdir, args.steps, None,
                     args.script_args, args.chunks)
    if args.no_link:
        print("\nPart 2 skipped: --no-link")
        return 0 if ok else 1
    from coc_inject.bench.link import EmulatedLink, LinkError

    try:
        EmulatedLink.check_available()
    except LinkError as error:
        print(f"\nPart 2 (emulated {args.link_rate} link) skipped: {error}")
        return 0 if ok else 1
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        ok &= compare(f"Part 2: emulated {args.link_rate} link between the ranks (one core each), larger model",
                      workdir, LINK_STEPS, link, args.script_args or LINK_MODEL, args.chunks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
