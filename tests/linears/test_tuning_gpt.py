"""COC_PARALLEL_NUM=auto on a whole tiny megatron-core GPT (local spec) under torchrun: the same
losses as CoC off (TP 2 with SP; ~12 s a launch), every decision made in the first step and in the
report; a second run with the cache runs no trial; cached N>1 decisions run CoC."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import SITE, clean_env, torchrun  # noqa: E402

STEPS = 3
MODEL = ["--steps", str(STEPS), "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "256", "--num-attention-heads", "4"]
SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
CASES = [(2, True)]  # TP 4 and TP without SP: per layer in tests/linears/test_tuning.py and the layer suites


def launch(workdir, name, env, tp, sp):
    args = MODEL + ["--json", str(workdir / f"{name}.json")] + ([] if sp else ["--no-sequence-parallel"])
    proc = torchrun(SCRIPT, args, env, workdir, ranks=tp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads((workdir / f"{name}.json").read_text())["losses"]


def auto_env(workdir, name, cache="tune.json"):
    return clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM="auto", COC_TUNE_CACHE=str(workdir / cache),
                     COC_REPORT=str(workdir / f"{name}-{{rank}}.json"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for tp, sp in CASES:
        workdir = tmp_path_factory.mktemp(f"tp{tp}{'sp' if sp else ''}")
        _, off = launch(workdir, "off", clean_env(), tp, sp)
        first, auto = launch(workdir, "auto", auto_env(workdir, "auto"), tp, sp)
        results[(tp, sp)] = {"off": off, "auto": auto, "proc": first, "workdir": workdir}
    return results


@pytest.mark.parametrize("tp,sp", CASES, ids=["tp2-sp"])
def test_auto_trains_like_off(runs, tp, sp):
    run = runs[(tp, sp)]
    assert len(run["auto"]) == STEPS
    for off, auto in zip(run["off"], run["auto"]):
        assert abs(off - auto) <= 1e-5 * max(1.0, abs(off))
    for rank in range(tp):
        report = json.loads((run["workdir"] / f"auto-{rank}.json").read_text())
        decisions = report["auto_decisions"]
        assert decisions and all(d["source"] == "trials" for d in decisions)
        # Decided at each key's first call: every layer took one route for all its calls.
        names = [layer["name"] for layer in report["layers"]]
        assert len(names) == len(set(names)) and all(layer["calls"] == STEPS for layer in report["layers"])
        if rank == 0:
            said = [line for line in run["proc"].stderr.splitlines() if "] auto: " in line]
            assert len(said) == len(decisions)


def test_second_run_uses_the_cache(runs):
    run = runs[(2, True)]
    workdir = run["workdir"]
    proc, losses = launch(workdir, "again", auto_env(workdir, "again"), 2, True)
    assert losses == run["auto"]
    report = json.loads((workdir / "again-0.json").read_text())
    assert report["auto_decisions"] and all(d["source"] == "cache" for d in report["auto_decisions"])
    assert "(trials" not in proc.stderr


def test_cached_chunk_counts_run_coc(runs):
    # Rewrite every cached decision to N=2: the next run must chunk every tuned layer in 2.
    run = runs[(2, True)]
    workdir = run["workdir"]
    cache = json.loads((workdir / "tune.json").read_text())
    for entry in cache["entries"].values():
        entry["chunks"] = 2
    (workdir / "forced.json").write_text(json.dumps(cache))
    env = auto_env(workdir, "forced", cache="forced.json")
    _, losses = launch(workdir, "forced", env, 2, True)
    for off, forced in zip(run["off"], losses):
        assert abs(off - forced) <= 1e-5 * max(1.0, abs(off))
    report = json.loads((workdir / "forced-0.json").read_text())
    assert {layer["route"] for layer in report["layers"]} == {"chunked"}
    assert {layer["chunks"] for layer in report["layers"]} == {2}
