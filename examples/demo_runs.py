"""What every part of `make demo` does with its runs: start the training script under torchrun
(a CoC variant is only its environment), read rank 0's JSON, and compare: losses against a
reference, median step times after the warm-up, variants interleaved over rounds."""

import json
import statistics
import sys
from pathlib import Path

from launch import ROOT, SITE, clean_env, torchrun

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
LOSS_BOUND = 1e-5


def run(label, env, workdir, steps, link, extra_args, name=None, ranks=2):
    print(f"== {label}", flush=True)
    out = Path(workdir) / f"{name or label.split()[1].rstrip(':')}.json"
    proc = torchrun(SCRIPT, ["--steps", str(steps), "--json", str(out), *extra_args], env, workdir, link,
                    ranks=ranks)
    if proc.returncode != 0:
        print(proc.stderr[-5000:], file=sys.stderr)
        raise SystemExit(f"demo: the {label} run failed (exit {proc.returncode})")
    for line in proc.stderr.splitlines():
        if line.startswith("[coc-inject rank 0"):
            print("  ", line)
    return json.loads(out.read_text())


WARM_UP_STEPS = 3  # step 1: first calls and auto's trials; steps 2-3: glibc's malloc still raising its thresholds


def steady(result) -> float:
    """Median step time after the warm-up steps."""
    return statistics.median(steady_times(result))


def steady_times(result) -> list:
    """The step times after the warm-up. glibc returns large freed blocks to the kernel until its
    dynamic mmap / trim thresholds have grown, so the first steps fault memory in again (most for
    multi-copy's threads, each with its own arena); MALLOC_MMAP_THRESHOLD_ set removes it."""
    times = result["step_times"]
    return times[first_steady(len(times)) - 1:]


def first_steady(steps: int) -> int:
    """The first step ``steady`` counts: after the warm-up where at least 5 steps remain, else step 2."""
    return WARM_UP_STEPS + 1 if steps >= WARM_UP_STEPS + 5 else 2


def max_loss_diff(reference, result) -> float:
    return max(abs(a - b) for a, b in zip(reference["losses"], result["losses"]))


def loss_line(label, reference, results, against="CP=1") -> bool:
    worst = max(max_loss_diff(reference, r) for r in results)
    print(f"losses {label} vs {against} {'EQUAL' if worst <= LOSS_BOUND else 'DIFFERENT'} within {LOSS_BOUND:g} "
          f"(max |diff| {worst:.2e})")
    return worst <= LOSS_BOUND


def variant_runs(title, workdir, link, steps, script_args, rounds, variants, given, targets, show=None,
                 measured=None) -> tuple:
    """Runs ``variants`` ({name: environment}) ``rounds`` times, interleaved, beside the ``given`` results
    ({name: [results]}, "off" among them or among the variants); prints median step times against off and the targets.
    ``show(report path, environment)`` prints what each run did (its rank 0 COC_REPORT). ``measured(title,
    results)``: every run (off too) measures its communication (COC_MEASURE=1), each result's ``report`` its rank
    0's COC_REPORT, and this is called with them all at the end. Returns (losses equal, median step time per
    variant)."""
    print(f"\n### {title}", flush=True)
    results = {name: list(runs) for name, runs in given.items()}  # a variant also given: its new runs added
    for name in variants:
        results.setdefault(name, [])
    for round_ in range(rounds):
        for index, (name, extra) in enumerate(variants.items()):
            tag = f"run-{index}-{round_}"
            env = clean_env() if not extra and measured is None else clean_env(**{  # a variant may name its own PYTHONPATH
                "PYTHONPATH": str(SITE), "COC_TUNE_CACHE": str(Path(workdir) / f"tune-{tag}.json"),
                "COC_REPORT": str(Path(workdir) / f"report-{tag}-{{rank}}.json"),
                **({"COC_MEASURE": "1"} if measured is not None else {}), **extra})
            results[name].append(run(f"{name}: same command" + (" over the link" if link else ""), env, workdir,
                                     steps, link, script_args, name=tag))
            results[name][-1]["report"] = Path(workdir) / f"report-{tag}-0.json"
            if show is not None and extra:
                show(Path(workdir) / f"report-{tag}-0.json", extra)
    medians = {name: statistics.median(steady(r) for r in runs) for name, runs in results.items()}
    print(f"\n{'variant':<42} {'median step ms':>14} {'vs off':>7}")
    ok = True
    for name, median in medians.items():
        target = targets.get(name)
        print(f"{name:<42} {1e3 * median:14.1f} {medians['off'] / median:6.3f}x"
              + (f"  (target >= {target}x: {'met' if medians['off'] / median >= target else 'missed'})"
                 if target else ""))
    for name in variants:
        if name != "off":
            ok &= loss_line(name, results["off"][0], results[name], against="off")
    if measured is not None:
        measured(title, results)
    return ok, medians
