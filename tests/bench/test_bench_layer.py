"""``coc-inject bench --cases layer``: the micro-batch reaches the block, and the title and layer.json say which
split the copies ran (sequence copies at micro-batch 1, batch copies where the micro-batch divides)."""

import json

import pytest

from coc_inject.bench import run as bench_run
from coc_inject.bench.cases import layer


def test_coc_inject_bench_hands_its_micro_batch_to_the_layer_case(monkeypatch):
    seen = []
    monkeypatch.setattr(layer, "measure", lambda args: seen.append(args) or 0)
    assert bench_run.main(["--cases", "layer", "--micro-batch", "1", "--reps", "3", "--out", "x"]) == 0
    assert bench_run.main(["--cases", "layer", "--out", "x"]) == 0
    assert [(args.micro_batch, args.reps) for args in seen] == [(1, 3), (16, 10)]


@pytest.mark.parametrize("micro_batch,split", [(1, "sequence"), (2, "batch")])
def test_the_title_and_json_say_which_split_the_copies_ran(tmp_path, capsys, micro_batch, split):
    args = layer.build_parser().parse_args(["--micro-batch", str(micro_batch), "--reps", "1", "--seq", "32",
                                            "--hidden", "32", "--ffn", "32", "--heads", "4", "--chunks", "2",
                                            "--out", str(tmp_path)])
    assert layer.measure(args) == 0
    result = json.loads((tmp_path / "layer.json").read_text())
    assert result["copies"] == f"2 copies, {split} split"
    assert f"micro-batch {micro_batch}," in result["title"]
    assert result["title"].endswith(f"copies: 2 copies, {split} split")
    assert result["title"] in capsys.readouterr().out
    assert set(result["rows"]) == {"megatron", "coc", "copies", "coc+copies"}


def test_coc_inject_bench_hands_moe_and_its_ep_to_the_layer_case(monkeypatch):
    seen = []
    monkeypatch.setattr(layer, "measure", lambda args: seen.append(args) or 0)
    assert bench_run.main(["--cases", "layer", "--moe", "--ep", "1", "--out", "x"]) == 0
    assert bench_run.main(["--cases", "layer", "--out", "x"]) == 0
    assert [(args.moe, args.ep) for args in seen] == [(True, 1), (False, None)]


def test_the_moe_block_runs_as_copies_and_the_json_says_so(tmp_path):
    args = layer.build_parser().parse_args(["--moe", "--micro-batch", "2", "--reps", "1", "--seq", "32",
                                            "--hidden", "32", "--ffn", "32", "--heads", "4", "--chunks", "2",
                                            "--out", str(tmp_path)])
    assert layer.measure(args) == 0
    result = json.loads((tmp_path / "layer.json").read_text())
    # the block's one MLP is an MoE layer (EP 2: 4 experts), and the copies ran through it (not Megatron's block)
    assert result["copies"] == "2 copies, batch split, through 1 MoE layer"
    assert result["title"].startswith("one MoE (4 experts top-2 aux_loss, EP=2) TransformerBlock")
    assert set(result["rows"]) == {"megatron", "coc", "copies", "coc+copies"}
    assert all(row["ms"] > 0 for row in result["rows"].values())
