"""Context parallelism as users run it: the unmodified tiny GPT pretraining script under torchrun,
CP=2 on Megatron's local attention switched on by the environment (or MindSpeed's flags) only,
against the same script at CP=1 with Megatron's own attention."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import SITE, clean_env, torchrun  # noqa: E402

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
STEPS = 4
ARGS = ["--steps", str(STEPS), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", "128", "--micro-batch-size", "2", "--vocab-size", "128",
        "--no-sequence-parallel"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("cp_e2e")
    launches = {
        "cp1": (clean_env(OMP_NUM_THREADS="1"), [], 1),  # torchrun sets it for 2+ ranks only
        "ring": (clean_env(PYTHONPATH=str(SITE), COC_CP_ALGO="ring", COC_REPORT=str(work / "ring_{rank}.json")),
                 ["--context-parallel-size", "2"], 2),
        "mindspeed_flags": (clean_env(PYTHONPATH=str(SITE)), ["--context-parallel-size", "2", "--context-parallel-algo",
                                                               "ulysses_cp_algo", "--use-cp-send-recv-overlap"], 2),
    }
    results = {}
    for name, (env, extra, ranks) in launches.items():
        proc = torchrun(SCRIPT, [*ARGS, *extra, "--json", str(work / f"{name}.json")], env, work, ranks=ranks)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
        results[name] = (proc, json.loads((work / f"{name}.json").read_text()))
    return work, results


@pytest.mark.parametrize("name", ["ring", "mindspeed_flags"])
def test_losses_equal_cp1(runs, name):
    _, results = runs
    want, got = results["cp1"][1]["losses"], results[name][1]["losses"]
    assert len(got) == STEPS and got[0] > got[-1]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


@pytest.mark.parametrize("name,algorithm", [("ring", "ring"), ("mindspeed_flags", "ulysses")])
def test_banner_and_first_step_summary_say_what_ran(runs, name, algorithm):
    proc, _ = runs[1][name]
    assert "context parallelism installed on DotProductAttention" in proc.stderr
    assert f"context parallelism on 2 attention layers ({algorithm}, CP=2, kernel cpu-flash): 2 calls" in proc.stderr, proc.stderr[-3000:]


def test_report_lists_every_attention_layer(runs):
    work, _ = runs
    for rank in range(2):
        report = json.loads((work / f"ring_{rank}.json").read_text())
        attention = [layer for layer in report["layers"] if layer["route"] == "context-parallel"]
        assert sorted(layer["name"] for layer in attention) == [
            f"decoder.layers.{i}.self_attention.core_attention" for i in range(2)]
        assert all((layer["class"], layer["algorithm"], layer["cp_size"], layer["calls"])
                   == ("DotProductAttention", "ring", 2, STEPS) for layer in attention)
        assert report["calls"]["context-parallel"] == 2 * STEPS
        assert report["config"]["cp_algorithm"] == "ring"
