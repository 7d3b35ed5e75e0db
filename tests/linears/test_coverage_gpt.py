"""COC_REPORT from a real megatron-core GPT (local spec, TP 2) run by an unmodified script under
torchrun, SP on and off: every Column/Row layer of the model is in each rank's report with the
route, chunk count and call count the product really took."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import RANKS, coc_env, torchrun  # noqa: E402

STEPS = 2
LAYERS = 2
MODEL = ["--steps", str(STEPS), "--num-layers", str(LAYERS), "--hidden-size", "64", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--micro-batch-size", "2", "--vocab-size", "256", "--num-attention-heads", "4"]
COLUMNS = [f"decoder.layers.{i}.{name}" for i in range(LAYERS)
           for name in ("self_attention.linear_qkv", "mlp.linear_fc1")] + ["output_layer"]
ROWS = [f"decoder.layers.{i}.{name}" for i in range(LAYERS) for name in ("self_attention.linear_proj", "mlp.linear_fc2")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = {}
    for sp in (True, False):
        workdir = tmp_path_factory.mktemp("sp" if sp else "nosp")
        args = MODEL + ([] if sp else ["--no-sequence-parallel"])
        proc = torchrun(ROOT / "examples" / "pretrain_tiny_gpt.py", args,
                        coc_env(4, COC_REPORT=str(workdir / "coc-{rank}.json")), workdir)
        assert proc.returncode == 0, proc.stderr[-3000:]
        reports = [json.loads((workdir / f"coc-{rank}.json").read_text()) for rank in range(RANKS)]
        results[sp] = (proc, reports, workdir)
    return results


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_every_tensor_parallel_layer_is_reported(runs, sp):
    _, reports, _ = runs[sp]
    for rank, report in enumerate(reports):
        assert report["rank"] == rank and report["megatron_core"]
        layers = {layer["name"]: layer for layer in report["layers"]}
        assert sorted(layers) == sorted(COLUMNS + ROWS)
        for name in ROWS:
            assert layers[name]["class"] == "RowParallelLinear"
            assert (layers[name]["route"], layers[name]["chunks"], layers[name]["calls"]) == ("chunked", 4, STEPS)
        for name in COLUMNS:
            layer = layers[name]
            assert layer["class"] == "ColumnParallelLinear" and layer["calls"] == STEPS
            if sp:
                assert (layer["route"], layer["chunks"], layer["reason"]) == ("chunked", 4, None)
            else:
                assert (layer["route"], layer["chunks"]) == ("megatron", None)
                assert "no sequence parallelism" in layer["reason"]
        assert report["local_layers"] == len(COLUMNS) + len(ROWS) and report["foreign_layers"] == {}
        m = 32 * 2
        assert layers["output_layer"]["shape"] == [m, 64, 256 // RANKS]


def test_summary_line_once_on_rank_zero(runs):
    proc, _, _ = runs[False]
    lines = [line for line in proc.stderr.splitlines() if "first step:" in line]
    # The first step: one call of each layer; without SP only the 4 Row layers run CoC.
    assert len(lines) == 1 and lines[0].startswith("[coc-inject rank 0] first step: CoC on 4 of 9 TP linear layers")
    assert "layer calls: 4 chunked (N=4), 5 Megatron's own; Megatron's path because: no sequence parallelism" in lines[0]


def test_cli_reads_the_reports_of_the_job(runs):
    _, _, workdir = runs[True]
    paths = [str(workdir / f"coc-{rank}.json") for rank in range(RANKS)]
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "report", *paths], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for rank, path in enumerate(paths):
        assert f"{path}: rank {rank}/2" in proc.stdout
    assert proc.stdout.count("output_layer") == RANKS


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("auto")
    env = coc_env("auto", COC_MULTI_COPY="auto", COC_TUNE_CACHE="off", COC_REPORT=str(workdir / "coc-{rank}.json"))
    proc = torchrun(ROOT / "examples" / "pretrain_tiny_gpt.py", MODEL, env, workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, [json.loads((workdir / f"coc-{rank}.json").read_text()) for rank in range(RANKS)]


def test_auto_counts_the_jobs_calls_and_lists_its_trials_apart(auto_run):
    # COC_PARALLEL_NUM=auto with COC_MULTI_COPY=auto: the block's trials run the linears on half the batch at
    # the first step; the counts are the job's calls, one per layer and step, as without auto (issue 33, item 8).
    proc, reports = auto_run
    for report in reports:
        linears = [row for row in report["layers"] if row["class"] in ("ColumnParallelLinear", "RowParallelLinear")]
        calls: dict = {}
        for row in linears:
            calls[row["name"]] = calls.get(row["name"], 0) + row["calls"]
        assert calls == dict.fromkeys(COLUMNS + ROWS, STEPS), linears
        for row in linears:
            if row["reason"] and " for [" in row["reason"]:  # auto's reason names the shape it decided for
                assert row["reason"].endswith(f" for {row['shape']}"), row
        assert sum(report["trial_calls"].values()) > 0 and report["trials"], report["trial_calls"]
        assert sum(row["calls"] for row in report["trials"]) == sum(report["trial_calls"].values())
    line = next(line for line in proc.stderr.splitlines() if "first step:" in line)
    routes = line.split("layer calls: ")[1].split(";")[0]
    assert sum(int(part.split()[0]) for part in routes.split(", ")) == len(COLUMNS + ROWS), line
    assert "apart from these, auto's trials: " in line, line
