"""Interpreter start-up cost of the coc-inject bootstrap, for a process that never imports Megatron.

Variants, all ``<python> -c pass`` with the same interpreter:
  bare  PYTHONPATH unset, no CoC variables
  off   bootstrap directory on PYTHONPATH, no CoC variables
  on    bootstrap directory on PYTHONPATH, COC_PARALLEL_NUM=4

The variants are interleaved within each repetition (in a rotating order) because these
VMs are noisy; the report gives the median wall time per variant and the median of the
per-repetition differences against ``bare``. Target: each difference <= 3 ms.

    python -m coc_inject.bench.startup [--reps N] [--json PATH] [--python EXE]
    (also: python benchmarks/startup.py, make bench-startup)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from coc_inject.bootstrap import bootstrap_dir

SITE_DIR = bootstrap_dir()
TARGET_MS = 3.0
VARIANTS = ("bare", "off", "on")
_COC_VARS = (
    "COC_DISABLE",
    "COC_PARALLEL_NUM",
    "USE_COC_FUSED_KERNEL",
    "COC_CUSTOMIZED",
    "COC_CONFIG",
    "COC_LOG_LEVEL",
)


def variant_envs() -> dict[str, dict[str, str]]:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in _COC_VARS and not k.startswith("COC_") and not k.startswith("PYTHON")
    }
    bare = dict(base)
    off = dict(base, PYTHONPATH=str(SITE_DIR))
    on = dict(off, COC_PARALLEL_NUM="4")
    return {"bare": bare, "off": off, "on": on}


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(python: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one ``python -c pass`` (process creation and reaping included).

    CPU time (user + system of the child) is a cross-check that is less sensitive to other
    load on the machine than wall time.
    """
    c0 = _children_cpu_s()
    t0 = time.perf_counter_ns()
    proc = subprocess.run(
        [python, "-c", "pass"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    elapsed = (time.perf_counter_ns() - t0) / 1e6
    cpu = (_children_cpu_s() - c0) * 1e3
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(
            f"startup benchmark: {python} -c pass failed (rc {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
    return elapsed, cpu


def check_variants(python: str, envs: dict[str, dict[str, str]]) -> None:
    """Make sure each variant is what it claims to be (bootstrap absent / present, trigger off / on)."""
    probe = (
        "import sys; sc = sys.modules.get('sitecustomize'); "
        "f = getattr(sc, '__file__', '') or ''; "
        "print(int(f.endswith('sitecustomize/sitecustomize.py') or f.endswith('_site/sitecustomize.py')), "
        "int(any(type(x).__module__ == 'coc_inject.bootstrap' for x in sys.meta_path)))"
    )
    expected = {"bare": "0 0", "off": "1 0", "on": "1 1"}
    for name, env in envs.items():
        out = subprocess.run(
            [python, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        if out != expected[name]:
            raise SystemExit(f"startup benchmark: variant {name!r} is not set up as intended ({out!r})")


def measure(python: str, reps: int, warmup: int = 5) -> tuple[dict, dict]:
    """Per-variant lists of wall ms and of CPU ms, one entry per repetition."""
    envs = variant_envs()
    check_variants(python, envs)
    for _ in range(warmup):  # fill page cache / __pycache__
        for name in VARIANTS:
            run_once(python, envs[name])
    wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for rep in range(reps):
        shift = rep % len(VARIANTS)
        for name in VARIANTS[shift:] + VARIANTS[:shift]:
            w, c = run_once(python, envs[name])
            wall[name].append(w)
            cpu[name].append(c)
    return wall, cpu


def _deltas(times: dict[str, list[float]]) -> dict[str, float]:
    return {
        name: statistics.median(a - b for a, b in zip(times[name], times["bare"]))
        for name in VARIANTS
        if name != "bare"
    }


def summarize(times: dict[str, list[float]], cpu: dict[str, list[float]], python: str) -> dict:
    reps = len(times["bare"])
    median = {name: statistics.median(values) for name, values in times.items()}
    delta = _deltas(times)
    return {
        "python": python,
        "python_version": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "reps": reps,
        "median_ms": {k: round(v, 3) for k, v in median.items()},
        "p10_ms": {k: round(statistics.quantiles(v, n=10)[0], 3) for k, v in times.items()},
        "p90_ms": {k: round(statistics.quantiles(v, n=10)[-1], 3) for k, v in times.items()},
        "median_delta_vs_bare_ms": {k: round(v, 3) for k, v in delta.items()},
        "cpu_median_ms": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
        "cpu_median_delta_vs_bare_ms": {k: round(v, 3) for k, v in _deltas(cpu).items()},
        "target_ms": TARGET_MS,
        "pass": all(v <= TARGET_MS for v in delta.values()),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=200, help="repetitions per variant (default 200)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument(
        "--python", default=sys.executable,
        help="interpreter to measure (default: the one running this script)",
    )
    args = parser.parse_args(argv)
    if args.reps < 2:
        parser.error("--reps must be at least 2")

    times, cpu = measure(args.python, args.reps)
    result = summarize(times, cpu, args.python)

    print(f"interpreter start-up, `{args.python} -c pass`, {result['reps']} interleaved repetitions")
    print(
        f"{'variant':<8}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'median Δ vs bare':>18}"
        f"{'CPU ms':>9}{'CPU Δ':>8}"
    )
    for name in VARIANTS:
        d = result["median_delta_vs_bare_ms"].get(name)
        c = result["cpu_median_delta_vs_bare_ms"].get(name)
        print(
            f"{name:<8}{result['median_ms'][name]:>11.2f}{result['p10_ms'][name]:>9.2f}"
            f"{result['p90_ms'][name]:>9.2f}{'-' if d is None else f'{d:+.2f}':>18}"
            f"{result['cpu_median_ms'][name]:>9.2f}{'-' if c is None else f'{c:+.2f}':>8}"
        )
    verdict = "PASS" if result["pass"] else "FAIL"
    worst = max(result["median_delta_vs_bare_ms"].values())
    print(f"{verdict}: worst median overhead {worst:+.2f} ms (target <= {TARGET_MS:.0f} ms, CoC off and on)")

    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(dict(result, samples_wall_ms=times, samples_cpu_ms=cpu), indent=1) + "\n"
        )
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
