"""Interpreter start-up cost of the coc-inject bootstrap, for a process that never imports Megatron.

Variants, all ``<python> -c pass`` with the same interpreter:
  bare            PYTHONPATH unset, no CoC variables
  off             bootstrap directory on PYTHONPATH, no CoC variables
  on              bootstrap directory on PYTHONPATH, COC_PARALLEL_NUM=4
  nopyc_off       a copy of the bootstrap as a checkout has it (``sitecustomize/`` and
                  ``coc_inject/``, sources only) on PYTHONPATH, PYTHONDONTWRITEBYTECODE=1, so no
                  ``__pycache__`` ever appears next to it (a read-only checkout in a Docker image);
                  COC_CACHE_DIR is a per-run temporary directory, already filled by earlier starts
  nopyc_on        the same, COC_PARALLEL_NUM=4
  nopyc_off_cold  like nopyc_off, but each start gets a new, not yet existing COC_CACHE_DIR: the
  nopyc_on_cold   first start of a user (for information; not part of the target)

The variants are interleaved within each repetition (in a rotating order) because these
VMs are noisy; the report gives the median wall time per variant and the median of the
per-repetition differences against ``bare``. Target: each difference <= 3 ms, except the
``_cold`` ones.

    python -m coc_inject.bench.startup [--reps N] [--json PATH] [--python EXE]
    (also: python benchmarks/startup.py, make bench-startup)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from coc_inject import bootstrap, meter
from coc_inject.bootstrap import bootstrap_dir

SITE_DIR = bootstrap_dir()
PACKAGE_DIR = Path(bootstrap.__file__).resolve().parent
TARGET_MS = 3.0
COLD_VARIANTS = ("nopyc_off_cold", "nopyc_on_cold")
VARIANTS = ("bare", "off", "on", "nopyc_off", "nopyc_on") + COLD_VARIANTS
TARGET_VARIANTS = ("off", "on", "nopyc_off", "nopyc_on")
_COC_VARS = (
    "COC_DISABLE",
    "COC_PARALLEL_NUM",
    "USE_COC_FUSED_KERNEL",
    "COC_CUSTOMIZED",
    "COC_CONFIG",
    "COC_LOG_LEVEL",
)


def copy_bootstrap(dest: Path) -> Path:
    """Copy the bootstrap into ``dest`` the way a checkout holds it, without any byte code:
    ``dest/sitecustomize/sitecustomize.py`` and the ``dest/coc_inject`` package (sources only;
    an installed package's ``_site`` is left out, a checkout has none). Returns the directory
    to put on PYTHONPATH."""
    shutil.copytree(PACKAGE_DIR, dest / "coc_inject",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "_site"))
    (dest / "sitecustomize").mkdir()
    shutil.copy2(Path(SITE_DIR) / "sitecustomize.py", dest / "sitecustomize" / "sitecustomize.py")
    return dest / "sitecustomize"


def variant_envs(nopyc_root: Path | None = None) -> dict[str, dict[str, str]]:
    """The environment of each variant. Without ``nopyc_root`` (a scratch directory), only
    bare / off / on. The ``_cold`` variants get their COC_CACHE_DIR per start (see measure())."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in _COC_VARS and not k.startswith("COC_") and not k.startswith("PYTHON")
    }
    bare = dict(base)
    off = dict(base, PYTHONPATH=str(SITE_DIR))
    on = dict(off, COC_PARALLEL_NUM="4")
    envs = {"bare": bare, "off": off, "on": on}
    if nopyc_root is not None:
        site = copy_bootstrap(nopyc_root)
        nopyc = dict(base, PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
        warm = dict(nopyc, COC_CACHE_DIR=str(nopyc_root / "cache"))
        envs.update(nopyc_off=warm, nopyc_on=dict(warm, COC_PARALLEL_NUM="4"),
                    nopyc_off_cold=dict(nopyc), nopyc_on_cold=dict(nopyc, COC_PARALLEL_NUM="4"))
    return envs


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_once(python: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall ms, CPU ms) of one ``python -c pass`` (process creation and reaping included).

    CPU time (user + system of the child) is a cross-check that is less sensitive to other
    load on the machine than wall time.
    """
    c0 = _children_cpu_s()
    t0 = meter.now()
    proc = subprocess.run(
        [python, "-c", "pass"], env=env, stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    elapsed = (meter.now() - t0) * 1e3
    cpu = (_children_cpu_s() - c0) * 1e3
    if proc.returncode != 0 or proc.stderr:
        raise SystemExit(
            f"startup benchmark: {python} -c pass failed (rc {proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()}"
        )
    return elapsed, cpu


_EXPECTED = {"bare": "0 0", "off": "1 0", "on": "1 1", "nopyc_off": "1 0", "nopyc_on": "1 1",
             "nopyc_off_cold": "1 0", "nopyc_on_cold": "1 1"}
_PROBE = (
    "import json, sys; sc = sys.modules.get('sitecustomize'); ci = sys.modules.get('coc_inject'); "
    "print(json.dumps([getattr(sc, '__file__', '') or '', getattr(ci, '__file__', '') or '', "
    "any(type(x).__module__ == 'coc_inject.bootstrap' for x in sys.meta_path)]))"
)


def check_variants(python: str, envs: dict[str, dict[str, str]]) -> None:
    """Make sure each variant is what it claims to be: bootstrap absent / present (the checkout's
    or the byte-code-free copy, with that copy's package), trigger off / on, and no
    ``__pycache__`` written next to the copy."""
    for name, env in envs.items():
        out = subprocess.run(
            [python, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        site_file, package_file, trigger = json.loads(out)
        ours = site_file.endswith(("sitecustomize/sitecustomize.py", "_site/sitecustomize.py"))
        got = f"{int(ours)} {int(trigger)}"  # the format of the report this check always gave
        expected = _EXPECTED[name]
        if name.startswith("nopyc"):
            site = Path(env["PYTHONPATH"])
            copy_ok = (site_file == str(site / "sitecustomize.py")
                       and package_file == str(site.parent / "coc_inject" / "__init__.py")
                       and not any(site.parent.rglob("__pycache__")))
            if not copy_ok:
                got += f" (sitecustomize {site_file!r}, coc_inject {package_file!r}, or byte code next to the copy)"
        if got != expected:
            raise SystemExit(f"startup benchmark: variant {name!r} is not set up as intended ({got!r})")


def _cache_files(envs: dict[str, dict[str, str]]) -> int:
    """How many byte-code files the warm no-pyc variants' COC_CACHE_DIR holds."""
    cache = envs.get("nopyc_off", {}).get("COC_CACHE_DIR")
    return sum(1 for _ in Path(cache).rglob("*.pyc")) if cache else 0


def measure(python: str, reps: int, warmup: int = 5, info: dict | None = None) -> tuple[dict, dict]:
    """Per-variant lists of wall ms and of CPU ms, one entry per repetition.

    ``info``, if given, receives ``nopyc_cache_files``: the number of .pyc files in the warm
    variants' cache directory afterwards (0 means the bootstrap does not use the cache).
    """
    with tempfile.TemporaryDirectory(prefix="coc-startup-") as scratch:
        scratch = Path(scratch)
        envs = variant_envs(scratch / "nopyc")
        fresh = (str(scratch / "cold" / str(n)) for n in itertools.count())

        def env_for(name):
            return dict(envs[name], COC_CACHE_DIR=next(fresh)) if name in COLD_VARIANTS else envs[name]

        check_variants(python, {name: env_for(name) for name in VARIANTS})
        for _ in range(warmup):  # fill page cache, __pycache__ and the warm COC_CACHE_DIR
            for name in VARIANTS:
                run_once(python, env_for(name))
        wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
        cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for rep in range(reps):
            shift = rep % len(VARIANTS)
            for name in VARIANTS[shift:] + VARIANTS[:shift]:
                w, c = run_once(python, env_for(name))
                wall[name].append(w)
                cpu[name].append(c)
        if info is not None:
            info["nopyc_cache_files"] = _cache_files(envs)
    return wall, cpu


def _deltas(times: dict[str, list[float]]) -> dict[str, float]:
    return {
        name: statistics.median(a - b for a, b in zip(times[name], times["bare"]))
        for name in times
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
        "target_variants": [k for k in delta if k not in COLD_VARIANTS],
        "pass": all(v <= TARGET_MS for k, v in delta.items() if k not in COLD_VARIANTS),
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

    info: dict = {}
    times, cpu = measure(args.python, args.reps, info=info)
    result = dict(summarize(times, cpu, args.python), **info)

    print(f"interpreter start-up, `{args.python} -c pass`, {result['reps']} interleaved repetitions")
    print(
        f"{'variant':<16}{'median ms':>11}{'p10 ms':>9}{'p90 ms':>9}{'median Δ vs bare':>18}"
        f"{'CPU ms':>9}{'CPU Δ':>8}"
    )
    for name in times:
        d = result["median_delta_vs_bare_ms"].get(name)
        c = result["cpu_median_delta_vs_bare_ms"].get(name)
        print(
            f"{name:<16}{result['median_ms'][name]:>11.2f}{result['p10_ms'][name]:>9.2f}"
            f"{result['p90_ms'][name]:>9.2f}{'-' if d is None else f'{d:+.2f}':>18}"
            f"{result['cpu_median_ms'][name]:>9.2f}{'-' if c is None else f'{c:+.2f}':>8}"
        )
    print(f"nopyc_*: PYTHONDONTWRITEBYTECODE=1, no __pycache__ next to the bootstrap; byte code in "
          f"COC_CACHE_DIR: {result['nopyc_cache_files']} file(s); _cold = the first start with an empty cache")
    verdict = "PASS" if result["pass"] else "FAIL"
    worst = max(result["median_delta_vs_bare_ms"][name] for name in result["target_variants"])
    cold = max(result["median_delta_vs_bare_ms"][name] for name in COLD_VARIANTS)
    print(f"{verdict}: worst median overhead {worst:+.2f} ms (target <= {TARGET_MS:.0f} ms, CoC off and on, "
          f"with and without __pycache__); first start with an empty cache {cold:+.2f} ms (not in the target)")

    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(dict(result, samples_wall_ms=times, samples_cpu_ms=cpu), indent=1) + "\n"
        )
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
