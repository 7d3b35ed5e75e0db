"""Multi-copy parallel as users run it: the unmodified tiny GPT pretraining script under torchrun,
TP=2 with sequence parallelism, COC_MULTI_COPY=2 set in the environment only (it arms coc-inject
on its own), against the same script without coc-inject; at micro-batch 4 (batch copies) and 1
(sequence copies)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import SITE, clean_env, torchrun  # noqa: E402

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
STEPS = 3
ARGS = ["--steps", str(STEPS), "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--ffn-hidden-size", "128", "--seq-length", "64", "--micro-batch-size", "4", "--vocab-size", "128"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("multi_copy_e2e")
    launches = {
        "off": (clean_env(), []),
        "copies": (clean_env(PYTHONPATH=str(SITE), COC_MULTI_COPY="2", COC_REPORT=str(work / "copies_{rank}.json")), []),
        "off1": (clean_env(), ["--micro-batch-size", "1"]),
        "sequence": (clean_env(PYTHONPATH=str(SITE), COC_MULTI_COPY="2", COC_REPORT=str(work / "sequence_{rank}.json")),
                     ["--micro-batch-size", "1"]),
    }
    results = {}
    for name, (env, extra) in launches.items():
        proc = torchrun(SCRIPT, [*ARGS, *extra, "--json", str(work / f"{name}.json")], env, work)
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
        results[name] = (proc, json.loads((work / f"{name}.json").read_text()))
    return work, results


@pytest.mark.parametrize("copies,off", [("copies", "off"), ("sequence", "off1")])
def test_losses_equal_no_copies(runs, copies, off):
    _, results = runs
    want, got = results[off][1]["losses"], results[copies][1]["losses"]
    assert len(got) == STEPS and got[0] > got[-1]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (got, want)


def test_banner_and_first_step_summary_say_what_ran(runs):
    proc, _ = runs[1]["copies"]
    banner = next(line for line in proc.stderr.splitlines() if "multi-copy installed on TransformerBlock" in line)
    assert "2 copies" in banner and len(banner) < 160, banner
    assert "multi-copy 2 on 2 layers (1 block): 1 calls (batch split 1)" in proc.stderr, proc.stderr[-3000:]
    proc, _ = runs[1]["sequence"]
    assert "multi-copy 2 on 2 layers (1 block): 1 calls (sequence split 1)" in proc.stderr, proc.stderr[-3000:]


def test_report_lists_the_block_and_what_its_copies_split(runs):
    work, _ = runs
    for name, split in (("copies", "batch"), ("sequence", "sequence")):
        for rank in range(2):
            report = json.loads((work / f"{name}_{rank}.json").read_text())
            blocks = [layer for layer in report["layers"] if layer["route"] == "multi-copy"]
            assert [(b["name"], b["class"], b["layers"], b["copies"], b["reason"], b["backward_in_turn"], b["split"],
                     b["calls"]) for b in blocks] == [("decoder", "TransformerBlock", 2, 2, None, None, split, STEPS)], \
                blocks
            assert report["calls"]["multi-copy"] == STEPS and report["config"]["multi_copy"] == 2
