"""MoE as users run it: the unmodified tiny GPT pretraining script under torchrun with 4 experts per
MLP, EP 2 (TP 1, 2 data-parallel replicas), COC_MOE_OVERLAP set in the environment only (it arms
coc-inject on its own), against the same script without coc-inject; and MindSpeed's flag."""

import json
import sys
from pathlib import Path

import pytest

from coc_inject.megatron_version import importable, release

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import SITE, clean_env, torchrun  # noqa: E402

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
STEPS = 3
ARGS = ["--steps", str(STEPS), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "128",
        "--num-experts", "4", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("moe_e2e")

    def coc(name, **settings):
        return clean_env(PYTHONPATH=str(SITE), COC_REPORT=str(work / f"{name}_{{rank}}.json"),
                         COC_TUNE_CACHE="off", **settings)

    launches = {
        "off": (clean_env(), []),
        # Pieces by MindSpeed's flag (taken out of argv: it reads as COC_MOE_OVERLAP=1, the settings
        # suites parse that variable); auto by the environment.
        "pieces": (coc("pieces"), ["--moe-alltoall-overlap-comm"]),
        "auto": (coc("auto", COC_MOE_OVERLAP="auto"), []),
        # The data-parallel gradient all-reduce during the backward (Megatron's DDP --overlap-grad-reduce,
        # make demo's MoE job): post-accumulate hooks fire once per parameter beside the pieces' gradients.
        "auto-overlap-grad-reduce": (coc("auto_overlap", COC_MOE_OVERLAP="auto"),
                                                    ["--overlap-grad-reduce"]),
    }
    results = {}
    for name, (env, extra) in launches.items():
        proc = torchrun(SCRIPT, [*ARGS, *extra, "--json", str(work / f"{name}.json")], env, work)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
        results[name] = (proc, json.loads((work / f"{name}.json").read_text()))
    return work, results


@pytest.mark.parametrize("name", ["pieces", "auto", "auto-overlap-grad-reduce"])
def test_losses_equal_off(runs, name):
    _, results = runs
    want, got = results["off"][1]["losses"], results[name][1]["losses"]
    assert len(got) == STEPS and got[0] > got[-1]
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (got, want)


def test_banner_summary_and_report_say_what_ran(runs):
    work, results = runs
    proc, _ = results["pieces"]
    banner = next(line for line in proc.stderr.splitlines() if "MoE overlap installed on MoELayer" in line)
    assert len(banner) < 160, banner
    assert "MoE all-to-alls in pieces on 2 layers (8 pieces): 2 calls" in proc.stderr, proc.stderr[-3000:]
    assert "runs Megatron's path" not in proc.stderr and "no MoE layer call" not in proc.stderr
    for rank in range(2):
        report = json.loads((work / f"pieces_{rank}.json").read_text())
        layers = [(layer["name"], layer["pieces"], layer["chunks"], layer["reason"], layer["calls"])
                  for layer in report["layers"] if layer["route"] == "moe"]
        assert layers == [(f"decoder.layers.{i}.mlp", 8, 4, None, STEPS) for i in range(2)], layers
        assert report["calls"]["moe"] == 2 * STEPS and report["config"]["moe_overlap"] == "1"


def test_auto_decides_once_per_shape_the_same_on_both_ranks(runs):
    work, _ = runs
    decisions = [json.loads((work / f"auto_{rank}.json").read_text())["moe_decisions"] for rank in range(2)]
    assert len(decisions[0]) == 1 and decisions[0][0]["source"] == "trials"
    assert [d["chunks"] for d in decisions[0]] == [d["chunks"] for d in decisions[1]]
    assert set(decisions[0][0]["times_ms"]) == {"Megatron", "1 chunk(s)", "2 chunk(s)", "4 chunk(s)", "8 chunk(s)"}


def test_mindspeeds_flag_reads_as_pieces(runs):
    work, results = runs
    report = json.loads((work / "pieces_0.json").read_text())
    assert report["config"]["moe_overlap"] == "1"
    assert {layer["pieces"] for layer in report["layers"] if layer["route"] == "moe"} == {8}


@pytest.mark.parametrize("setting,words", [("0", "off (COC_MOE_OVERLAP=0)"), ("1", "at least 8 per layer"),
                                           ("auto", "as each layer shape's trials find fastest (auto)")])
def test_status_says_what_moe_overlap_does(setting, words):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "coc_inject", "status"], capture_output=True, text=True,
                          env=clean_env(COC_MOE_OVERLAP=setting))
    line = next(line for line in proc.stdout.splitlines() if line.startswith("MoE "))
    assert words in line and (setting == "0" or "the allgather and flex dispatchers" in line), line


# MindSpeed-LLM's shape (issue 42): TP 2 with sequence parallelism x EP 2 (expert TP 1: the EP group spans
# the TP ranks), the local spec, the alltoall dispatcher. make test runs it on 0.12.1 too, MindSpeed's release,
# where the pieces take over its dispatcher's token_permutation / token_unpermutation.
TP_SP_EP = [*ARGS[:-2], "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1",
            "--disable-bias-linear"]


@pytest.mark.skipif(release(importable().version) != (0, 12),
                    reason="megatron-core 0.12 (MindSpeed's) only: test_moe's GPT cases run TP 2 SP x EP 2 elsewhere "
                           "(make test budget)")
@pytest.mark.parametrize("experts", ["sequential", "grouped"])
def test_tp2_sp_by_ep2_trains_as_off_with_the_moe_layers_in_pieces(tmp_path, experts):
    """SequentialMLP (8 pieces: 4 chunks of each of 2 local experts) and the legacy GroupedMLP
    (``--moe-grouped-gemm``, the grouped_gemm stand-in; 8 pieces, each a chunk of every local expert)."""
    script = SCRIPT if experts == "sequential" else ROOT / "tests" / "moe" / "grouped_job.py"
    chunks = 4 if experts == "sequential" else 8
    losses = {}
    for name, env in (("off", clean_env()),
                      ("pieces", clean_env(PYTHONPATH=str(SITE), COC_MOE_OVERLAP="1", COC_TUNE_CACHE="off",
                                           COC_REPORT=str(tmp_path / "pieces_{rank}.json"),
                                           # every wing this shape has: CoC's linears (TP 2 SP), the copies
                                           **({"COC_PARALLEL_NUM": "4", "COC_MULTI_COPY": "2"}
                                              if experts == "grouped" else {})))):
        proc = torchrun(script, [*TP_SP_EP, "--json", str(tmp_path / f"{name}.json")], env, tmp_path)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
        losses[name] = json.loads((tmp_path / f"{name}.json").read_text())["losses"]
    got, want = losses["pieces"], losses["off"]
    assert len(got) == STEPS and all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, want)), (got, want)
    for rank in range(2):
        report = json.loads((tmp_path / f"pieces_{rank}.json").read_text())
        layers = [(layer["name"], layer["pieces"], layer["chunks"], layer["reason"], layer["calls"])
                  for layer in report["layers"] if layer["route"] == "moe"]
        assert layers == [(f"decoder.layers.{i}.mlp", 8, chunks, None, STEPS) for i in range(2)], layers
        if experts == "grouped":  # the linears chunked (the copies step aside on 0.12's routing losses, saying so)
            assert report["calls"]["chunked"] > 0, report["calls"]
