"""``coc-inject tune`` (issue 10 item 4): offline decisions of COC_PARALLEL_NUM=auto through the
real megatron-core layers on local gloo ranks, written to the tune cache the engine reads, and the
equivalent COC_CUSTOMIZED; a second run takes them from the cache; argument errors."""

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from coc_inject.bench import tune
from coc_inject.config import AUTO, parse_customized

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^(\S+)\s+(row|row-sp|column-sp|column-bwd)\s+(\[[\d, ]+\])\s+(\d+)\s+(trials|cache)\s+(.*)$")


def run_tune(*argv):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC_"))}
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "tune", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [ROW.match(line).groups() for line in proc.stdout.splitlines() if ROW.match(line)]
    exports = [line for line in proc.stdout.splitlines() if line.startswith("export COC_CUSTOMIZED=")]
    assert len(exports) == 1, proc.stdout
    customized = json.loads(shlex.split(exports[0])[1].split("=", 1)[1])
    return proc, [(layer, case, json.loads(shape), int(n), source, times.split()) for layer, case, shape, n, source,
                  times in rows], customized


def cache_entries(path):
    """{(case, m, k, n): (chunks, times_ms, the rest of the key)} of a tune cache file."""
    entries = json.loads(Path(path).read_text())["entries"]
    out = {}
    for key, entry in entries.items():
        case, m, k, n, *rest = json.loads(key)
        out[(case, m, k, n)] = (entry["chunks"], entry["times_ms"], rest)
    return out


def test_explicit_shapes_are_cached_printed_and_reused_without_trials(tmp_path):
    cache = tmp_path / "tune.json"
    shapes = {("row-sp", 32, 16, 32), ("column-sp", 32, 32, 24)}
    argv = ["--shape", "row-sp:32,16,32", "--shape", "column-sp:32,32,24", "--cache", str(cache)]
    first, rows, customized = run_tune(*argv)

    entries = cache_entries(cache)
    assert set(entries) == shapes
    for chunks, times, (dtype, tp, device, backward, identity) in entries.values():
        assert (dtype, tp, device, backward) == ("float32", 2, "cpu", True)
        assert identity.endswith("; world 2; TP 2; gloo")
        assert set(times) == {"1", "2", "4", "8"}  # N=1 and every candidate (16 rows per rank allow 8)
        assert chunks in (1, 2, 4, 8)
    # Table: one row per shape, decided by trials, N as cached, each candidate's time as cached.
    assert {(case, *shape) for _, case, shape, _, _, _ in rows} == shapes and len(rows) == 2
    for layer, case, shape, n, source, times in rows:
        chunks, cached_times, _ = entries[(case, *shape)]
        assert (layer, source, n) == ("--shape", "trials", chunks)
        assert [float(t) for t in times[:4]] == pytest.approx([cached_times[c] for c in ("1", "2", "4", "8")],
                                                              abs=1.1e-3)  # printed to 3 decimals
    assert first.stderr.count("(trials: N=1") == 2  # the engine's own decision lines, rank 0
    # COC_CUSTOMIZED: exactly the tuned [m, k, n] -> the cached N, in a form the config accepts.
    assert customized == {f"[{m}, {k}, {n}]": entries[(case, m, k, n)][0] for case, m, k, n in shapes}
    assert dict(parse_customized("COC_CUSTOMIZED", json.dumps(customized))) == {
        (m, k, n): entries[(case, m, k, n)][0] for case, m, k, n in shapes}

    before = cache.read_bytes()
    second, rows_again, customized_again = run_tune(*argv)
    assert [(case, shape, n) for _, case, shape, n, _, _ in rows_again] == [(c, s, n) for _, c, s, n, _, _ in rows]
    assert {source for *_, source, _ in rows_again} == {"cache"}
    assert "(trials:" not in second.stderr and second.stderr.count("(cache)") == 2
    for (*_, times), (*_, times_again) in zip(rows, rows_again):  # the times as cached
        assert [float(t) for t in times_again[:4]] == pytest.approx([float(t) for t in times[:4]], abs=1.1e-3)
    assert customized_again == customized
    assert cache.read_bytes() == before  # nothing decided anew, nothing written


def test_model_dimensions_tune_the_gpt_layer_shapes(tmp_path):
    cache = tmp_path / "tune.json"
    # TP 2, m = 16 x 2; GQA: kv channels 32/4 = 8, qkv outputs 32 + 2*2*8 = 64 -> 32 per rank.
    _, rows, customized = run_tune("--hidden", "32", "--ffn", "96", "--seq", "16", "--micro-batch", "2",
                                   "--heads", "4", "--num-query-groups", "2", "--sequence-parallel",
                                   "--cache", str(cache))
    expected = [("linear_qkv", "column-sp", [32, 32, 32]), ("linear_proj", "row-sp", [32, 16, 32]),
                ("linear_fc1", "column-sp", [32, 32, 48]), ("linear_fc2", "row-sp", [32, 48, 32])]
    assert [(layer, case, shape) for layer, case, shape, *_ in rows] == expected
    entries = cache_entries(cache)
    assert set(entries) == {(case, *shape) for _, case, shape in expected}
    assert all(n == entries[(case, *shape)][0] for _, case, shape, n, *_ in rows)
    assert customized == {json.dumps(shape): entries[(case, *shape)][0] for _, case, shape in expected}


def test_four_local_ranks_with_tp_two_cache_under_world_four(tmp_path):
    cache = tmp_path / "tune.json"
    _, rows, customized = run_tune("--shape", "row:16,16,16", "--world", "4", "--tp", "2", "--cache", str(cache))
    (chunks, _, (dtype, tp, device, backward, identity)), = cache_entries(cache).values()
    assert tp == 2 and identity.endswith("; world 4; TP 2; gloo")
    assert rows[0][3] == chunks and customized == {"[16, 16, 16]": chunks}


def test_a_gpt_job_with_auto_takes_every_decision_from_the_pre_tuned_cache(tmp_path):
    # Offline: the tiny GPT's dimensions (TP 2, SP) plus its output layer (vocab 256 -> 128 per
    # rank, column SP). Online: the unmodified training script with COC_PARALLEL_NUM=auto and
    # that cache decides nothing itself.
    sys.path.insert(0, str(ROOT / "examples"))
    from launch import SITE, clean_env, torchrun

    cache = tmp_path / "tune.json"
    _, rows, _ = run_tune("--hidden", "64", "--ffn", "128", "--seq", "32", "--micro-batch", "2", "--heads", "4",
                          "--sequence-parallel", "--shape", "column-sp:64,64,128", "--cache", str(cache))
    tuned = {(case, *shape): n for _, case, shape, n, *_ in rows}
    env = clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM="auto", COC_TUNE_CACHE=str(cache),
                    COC_REPORT=str(tmp_path / "job-{rank}.json"))
    args = ["--steps", "2", "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length",
            "32", "--micro-batch-size", "2", "--vocab-size", "256", "--num-attention-heads", "4"]
    job = torchrun(ROOT / "examples" / "pretrain_tiny_gpt.py", args, env, tmp_path, ranks=2)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "(trials" not in job.stderr
    for rank in range(2):
        decisions = json.loads((tmp_path / f"job-{rank}.json").read_text())["auto_decisions"]
        assert {(d["case"], *d["shape"]): d["chunks"] for d in decisions} == tuned
        assert {d["source"] for d in decisions} == {"cache"}


# -- the mapping and the config, pure ------------------------------------------------------------


def _model_args(**overrides):
    values = dict(hidden=64, ffn=256, seq=8, micro_batch=4, heads=None, num_query_groups=None, swiglu=False,
                  sequence_parallel=False, column_backward=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def _fail(message):
    raise AssertionError(message)


def test_model_targets_without_sequence_parallelism():
    targets, notes = tune.model_targets(_model_args(), 4, _fail)
    assert [(t.layer, t.case, t.shape, t.batch) for t in targets] == [
        ("linear_proj", "row", (32, 16, 64), 4), ("linear_fc2", "row", (32, 64, 64), 4)]
    assert "COC_ENABLE_IN_COLUMN_BACKWARD=1" in notes[0]
    targets, notes = tune.model_targets(_model_args(column_backward=True, swiglu=True), 4, _fail)
    assert [(t.layer, t.case, t.shape) for t in targets] == [
        ("linear_qkv", "column-bwd", (32, 64, 48)), ("linear_proj", "row", (32, 16, 64)),
        ("linear_fc1", "column-bwd", (32, 64, 128)), ("linear_fc2", "row", (32, 64, 64))]
    assert notes == []


def test_a_shape_two_cases_decide_differently_is_auto_in_coc_customized():
    rows = [{"case": "column-sp", "shape": [64, 32, 32], "chunks": 2},
            {"case": "row-sp", "shape": [64, 32, 32], "chunks": 1},
            {"case": "row-sp", "shape": [64, 16, 32], "chunks": 4},
            {"case": "row-sp", "shape": [64, 16, 32], "chunks": 4}]
    chosen, conflicts = tune.customized(rows)
    assert chosen == {"[64, 32, 32]": "auto", "[64, 16, 32]": 4}
    assert conflicts == {"[64, 32, 32]": [("column-sp", 2), ("row-sp", 1)]}
    assert dict(parse_customized("COC_CUSTOMIZED", json.dumps(chosen))) == {(64, 32, 32): AUTO, (64, 16, 32): 4}


def _resolve(argv, environ):
    parser = tune.build_parser()
    return tune.resolve(parser.parse_args(argv), parser, environ)


def test_config_is_auto_with_the_jobs_other_settings_and_the_cache():
    environ = {"HOME": "/home/u", "COC_PARALLEL_NUM": "not read", "COC_CUSTOMIZED": "{}", "COC_DISABLE": "1",
               "COC_DETERMINISTIC": "1", "COC_RECOMPUTE_ALL_GATHER": "0", "COC_TUNE_CANDIDATES": "2,4"}
    targets, _, config, tp, world = _resolve(["--shape", "row:8,8,8"], environ)
    assert (config.parallel_num, config.enabled, config.deterministic, config.customized_coc) == (AUTO, True, False, ())
    assert config.enable_coc_in_column_backward and not config.recompute_all_gather
    assert config.tune_candidates == (2, 4) and config.tune_cache == "/home/u/.cache/coc-inject/tune.json"
    assert (tp, world, [t.shape for t in targets]) == (2, 2, [(8, 8, 8)])
    assert _resolve(["--shape", "row:8,8,8"], {**environ, "COC_TUNE_CACHE": "/c/t.json"})[2].tune_cache == "/c/t.json"
    config = _resolve(["--shape", "row:8,8,8", "--cache", "rel.json", "--candidates", "3,8"], environ)[2]
    assert config.tune_cache == os.path.abspath("rel.json") and config.tune_candidates == (3, 8)
    assert _resolve(["--shape", "row:8,8,8", "--cache", "off"], environ)[2].tune_cache is None
    # Under torchrun: TP defaults to the whole job.
    assert _resolve(["--shape", "row:8,8,8"], {**environ, "RANK": "0", "WORLD_SIZE": "4"})[3:] == (4, 4)


@pytest.mark.parametrize("argv,message", [
    (["--shape", "row-xx:64,16,32"], "argument --shape: 'row-xx:64,16,32' is invalid: expected CASE:M,K,N with "
                                     "CASE one of row, row-sp, column-sp, column-bwd"),
    (["--shape", "row:64,16"], "argument --shape: 'row:64,16' is invalid: expected CASE:M,K,N"),
    (["--shape", "row-sp:63,16,32"], "--shape=row-sp:63,16,32 is invalid: m=63 is not a multiple of --tp (2)"),
    (["--hidden", "0"], "argument --hidden: '0' is invalid: expected an integer >= 1"),
    (["--hidden", "33", "--ffn", "64", "--seq", "16", "--micro-batch", "1"],
     "--hidden=33 is invalid: expected a multiple of --tp (2)"),
    (["--hidden", "32", "--ffn", "64"], "model dimensions need --seq, --micro-batch as well"),
    (["--hidden", "32", "--ffn", "64", "--seq", "15", "--micro-batch", "1", "--sequence-parallel"],
     "--seq=15 is invalid: expected a multiple of --tp, with --sequence-parallel (2)"),
    (["--hidden", "32", "--ffn", "64", "--seq", "16", "--micro-batch", "1", "--heads", "6"],
     "--heads=6 is invalid: expected a divisor of --hidden (32)"),
    (["--hidden", "32", "--ffn", "64", "--seq", "16", "--micro-batch", "1", "--heads", "4", "--num-query-groups", "3"],
     "--num-query-groups=3 is invalid: expected a divisor of --heads (4)"),
    (["--shape", "row:8,8,8", "--tp", "1"], "--tp=1 is invalid: expected an integer >= 2"),
    (["--shape", "row:8,8,8", "--tp", "3", "--world", "4"], "--tp=3 is invalid: expected a divisor of the world size (4)"),
    (["--shape", "row:8,8,8", "--candidates", "1,4"], "--candidates='1,4' is invalid: expected a comma-separated "
                                                      "list of distinct integers >= 2"),
    (["--shape", "row:8,8,8", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8' (choose from"),
    ([], "nothing to tune: give --shape CASE:M,K,N (repeatable) and/or the model dimensions"),
])
def test_bad_arguments_name_the_option_the_value_and_what_is_allowed(argv, message, capsys, monkeypatch):
    from coc_inject.cli import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", *argv])  # fails before any rank starts
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "coc-inject tune: error: " in error and message in error, error
