"""``coc-inject tune`` (issue 10 item 4): offline decisions of COC_PARALLEL_NUM=auto through the
real megatron-core layers on local gloo ranks, written to the tune cache the engine reads, and the
equivalent COC_CUSTOMIZED; a second run takes them from the cache; argument errors."""

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from coc_inject.tune import report as tune_report, run as tune
from coc_inject.config import AUTO, load_config, parse_customized

ROOT = Path(__file__).resolve().parents[2]


def job_environment(env=None):
    """This environment without coc-inject's variables, plus ``env``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC_"))}, **(env or {})}


def tune_json(*argv, env=None):
    """(process, the result ``coc-inject tune --json`` printed)."""
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "tune", "--json", *argv], cwd=ROOT,
                          env=job_environment(env),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc, json.loads(proc.stdout)


def run_tune(*argv):
    """(process, the linears' rows as (layer, case, shape, N, source, times of N=1 and each candidate),
    COC_CUSTOMIZED as its printed export line sets it)."""
    proc, result = tune_json(*argv)
    linears = result["linears"]
    export = linears["export"]
    assert export.startswith("export COC_CUSTOMIZED="), export
    customized = json.loads(shlex.split(export)[1].split("=", 1)[1])
    assert customized == linears["customized"]
    counts = [1, *linears["candidates"]]
    return proc, [(row["layer"], row["case"], row["shape"], row["chunks"], row["source"],
                   [row["times_ms"].get(str(c)) for c in counts]) for row in linears["rows"]], customized


def run_tune_attention(*argv, env=None):
    """(process, attention rows as dicts, the job's environment after the fixed-choice export/unset
    lines, or None where there are none)."""
    proc, result = tune_json(*argv, env=env)
    rows = result["attention"]["rows"]
    lines = result["attention"]["shell"]
    if not lines:
        return proc, rows, None
    job_env = job_environment(env)
    for line in lines:
        command, *words = line.split()
        for word in words:
            if command == "export":
                job_env.update([word.split("=", 1)])
            else:
                job_env.pop(word, None)
    return proc, rows, job_env


def attention_entries(path):
    """{(seq, batch, heads, groups, dim, causal, cp, tp, backward): (choice, times_ms, identity)} of a tune cache."""
    out = {}
    for key, entry in json.loads(Path(path).read_text())["entries"].items():
        kind, seq, batch, heads, groups, dim, dtype, causal, cp, tp, device, backward, kernel, identity = \
            json.loads(key)
        assert (kind, dtype, device, kernel) == ("attention", "float32", "cpu", "cpu-flash")
        out[(seq, batch, heads, groups, dim, causal, cp, tp, backward)] = (entry["choice"], entry["times_ms"], identity)
    return out


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
                                                              abs=1.1e-3)  # the cache keeps 4 decimals
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
    # TP 2, m = 16 x 2; GQA: kv channels 32/4 = 8, qkv outputs 32 + 2*2*8 = 64 -> 32 per rank. (A world larger
    # than TP: the attention test, world 4, and tests/context_parallel/test_cp_gpt.py's job from a tune cache, world 4 = 2 CP groups.)
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


def test_attention_shapes_are_decided_by_the_engine_and_cached(tmp_path):
    # (a job taking them from the cache: tests/context_parallel/test_cp_gpt.py, test_a_job_takes_the_decision_of_coc_inject_tune...)
    # CP 4 with a Ulysses degree of 2: ring, ulysses, allgather and hybrid are the job's candidates.
    cache = tmp_path / "tune.json"
    # The second shape also forward-only: selective recompute runs a job's first call without autograd.
    argv = ["--shape", "attention:64,1,4,4,16", "--shape", "attention:32,1,4,2,8", "--cp", "4",
            "--recompute-activations", "--cache", str(cache)]
    first, rows, job_env = run_tune_attention(*argv, env={"COC_CP_ULYSSES_DEGREE": "2"})
    entries = attention_entries(cache)
    keys = [(64, 1, 4, 4, 16, True, 4, 1, True), (64, 1, 4, 4, 16, True, 4, 1, False),
            (32, 1, 4, 2, 8, True, 4, 1, True), (32, 1, 4, 2, 8, True, 4, 1, False)]
    assert set(entries) == set(keys)
    assert [row["key"] for row in rows] == [
        "attention seq 64 batch 1 heads 4/4 dim 16 float32 causal CP4 TP1 cpu cpu-flash",
        "attention seq 64 batch 1 heads 4/4 dim 16 float32 causal CP4 TP1 cpu forward-only cpu-flash",
        "attention seq 32 batch 1 heads 4/2 dim 8 float32 causal CP4 TP1 cpu cpu-flash",
        "attention seq 32 batch 1 heads 4/2 dim 8 float32 causal CP4 TP1 cpu forward-only cpu-flash"]
    for row, (choice, times, identity) in zip(rows, map(entries.get, keys)):
        assert identity.endswith("; world 4; CP 4; gloo")
        assert set(times) == {"ring", "ulysses", "allgather", "hybrid u=2"}
        assert (row["source"], row["choice"]) == ("trials", choice)
        assert row["times_ms"] == pytest.approx(times, abs=1.1e-3)
    assert first.stderr.count("(trials: ring") == 4  # the engine's own decision lines
    # The printed fixed choice, applied to the job's environment, is a valid config running exactly it.
    choices = {row["choice"] for row in rows}
    if len(choices) == 1:
        config = load_config(job_env)
        algorithm = {"ring": "ring", "ulysses": "ulysses", "allgather": "allgather", "hybrid u=2": "hybrid"}
        assert (config.cp_algorithm, config.cp_window) == (algorithm[choices.pop()], 1)
        assert config.cp_ulysses_degree == (2 if config.cp_algorithm == "hybrid" else None)
    else:
        assert job_env is None


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
    chosen, conflicts = tune_report.customized(rows)
    assert chosen == {"[64, 32, 32]": "auto", "[64, 16, 32]": 4}
    assert conflicts == {"[64, 32, 32]": [("column-sp", 2), ("row-sp", 1)]}
    assert dict(parse_customized("COC_CUSTOMIZED", json.dumps(chosen))) == {(64, 32, 32): AUTO, (64, 16, 32): 4}


def test_the_printed_text_says_what_the_json_says():
    rows = [{"layer": "linear_fc2", "case": "row", "shape": [32, 64, 64], "chunks": 2, "source": "trials",
             "times_ms": {"1": 2.5, "2": 1.25, "4": 1.5}, "noise_ms": 0.125, "cached": 1}]
    linears = {"candidates": [2, 4], "rows": rows, "warnings": ["w1"], "cache": "/c/t.json", "identity": "host h",
               "customized": {"[32, 64, 64]": 2}, "conflicts": {}, "export": "export COC_CUSTOMIZED=x"}
    text = tune_report.text({"where": "here", "dtype": "float32", "linears": linears, "attention": None,
                             "notes": ["n1"]}).splitlines()
    assert text[0].startswith("coc-inject tune: here, float32; candidates N=1 (Megatron's path), N=2, N=4; ")
    assert text[1].split() == ["layer", "case", "[m,", "k,", "n]", "N", "source", "N=1", "ms", "N=2", "ms", "N=4",
                               "ms", "noise", "ms"]
    assert text[2].split() == ["linear_fc2", "row", "[32,", "64,", "64]", "2", "trials", "2.500", "1.250", "1.500",
                               "0.125"]
    assert text[3:] == ["warning: w1", "cache: /c/t.json; identity host h: a COC_PARALLEL_NUM=auto job with this "
                        "identity, dtype and these shapes takes these decisions without trials",
                        "COC_CUSTOMIZED, the same choices for a job without auto ([m, k, n] as the engine keys them):",
                        "export COC_CUSTOMIZED=x", "note: n1"]


def _resolve(argv, environ):
    parser = tune.build_parser()
    return tune.resolve(parser.parse_args(argv), parser, environ)


def test_config_is_auto_with_the_jobs_other_settings_and_the_cache():
    environ = {"HOME": "/home/u", "COC_PARALLEL_NUM": "not read", "COC_CUSTOMIZED": "{}", "COC_DISABLE": "1",
               "COC_DETERMINISTIC": "1", "COC_RECOMPUTE_ALL_GATHER": "0", "COC_TUNE_CANDIDATES": "2,4"}
    plan = _resolve(["--shape", "row:8,8,8"], environ)
    config = plan.config
    assert (config.parallel_num, config.enabled, config.deterministic, config.customized_coc) == (AUTO, True, False, ())
    assert config.enable_coc_in_column_backward and not config.recompute_all_gather
    assert config.tune_candidates == (2, 4) and config.tune_cache == "/home/u/.cache/coc-inject/tune.json"
    assert (plan.tp, plan.cp, plan.world, [t.shape for t in plan.targets], plan.attention) == (2, 1, 2, [(8, 8, 8)], [])
    assert _resolve(["--shape", "row:8,8,8"], {**environ, "COC_TUNE_CACHE": "/c/t.json"}).config.tune_cache == \
        "/c/t.json"
    config = _resolve(["--shape", "row:8,8,8", "--cache", "rel.json", "--candidates", "3,8"], environ).config
    assert config.tune_cache == os.path.abspath("rel.json") and config.tune_candidates == (3, 8)
    assert _resolve(["--shape", "row:8,8,8", "--cache", "off"], environ).config.tune_cache is None
    # Under torchrun: TP defaults to the whole job.
    plan = _resolve(["--shape", "row:8,8,8"], {**environ, "RANK": "0", "WORLD_SIZE": "4"})
    assert (plan.tp, plan.world) == (4, 4)


MODEL = ["--hidden", "64", "--ffn", "128", "--seq", "32", "--micro-batch", "2", "--heads", "8",
         "--num-query-groups", "4"]


def test_cp_adds_the_core_attention_of_the_model_and_sizes_the_world():
    from coc_inject.tune.attention import AttentionTarget

    attention = AttentionTarget("core_attention", 32, 2, 8, 4, 8)
    # --cp alone: TP 1 (the linears have nothing to tune), world = CP.
    plan = _resolve([*MODEL, "--cp", "2"], {})
    assert (plan.tp, plan.cp, plan.world, plan.targets, plan.attention) == (1, 2, 2, [], [attention])
    assert plan.notes == ["TP 1: the linears have no collective to overlap; only the attention is tuned"]
    assert plan.config.cp_algorithm == "auto"
    # TP 2 x CP 2: the linears (each CP rank's rows: seq / CP x micro-batch = 16 x 2) and the attention,
    # world 4; the job's COC_CP_* settings are kept.
    plan = _resolve([*MODEL, "--cp", "2", "--tp", "2", "--attention-mask", "none"], {"COC_CP_WINDOW": "2"})
    assert (plan.tp, plan.world) == (2, 4)
    assert [(t.layer, t.case, t.shape) for t in plan.targets] == [("linear_proj", "row", (32, 32, 64)),
                                                                  ("linear_fc2", "row", (32, 64, 64))]
    assert plan.attention == [AttentionTarget("core_attention", 32, 2, 8, 4, 8, causal=False)]
    assert (plan.config.cp_algorithm, plan.config.cp_window) == ("auto", 2)
    plan = _resolve(["--shape", "attention:64,1,4,4,16", "--cp", "2", "--world", "8"], {})
    assert (plan.tp, plan.world, plan.attention) == (1, 8, [AttentionTarget("--shape", 64, 1, 4, 4, 16)])
    # Under torchrun: the world is the job's, TP is given (the rest may be data-parallel).
    plan = _resolve(["--shape", "attention:64,1,4,4,16", "--cp", "2", "--tp", "2"], {"RANK": "0", "WORLD_SIZE": "8"})
    assert (plan.tp, plan.cp, plan.world) == (2, 2, 8)


def test_a_variants_settings_run_it_without_auto():
    from coc_inject.tune.attention import fixed_settings, shell_lines
    from coc_inject.context_parallel.attention import Variant

    assert Variant("ring", window=2).settings() == {"COC_CP_ALGO": "ring", "COC_CP_WINDOW": "2",
                                                    "COC_CP_ULYSSES_DEGREE": None}
    assert Variant("hybrid", window=2, ulysses_degree=4).settings() == {
        "COC_CP_ALGO": "hybrid", "COC_CP_WINDOW": "2", "COC_CP_ULYSSES_DEGREE": "4"}
    ulysses = Variant("ulysses", ulysses_degree=4).settings()
    assert shell_lines(ulysses) == ["export COC_CP_ALGO=ulysses COC_CP_WINDOW=1", "unset COC_CP_ULYSSES_DEGREE"]
    ring = {"settings": Variant("ring").settings()}
    assert fixed_settings([ring, ring]) == Variant("ring").settings()
    assert fixed_settings([ring, {"settings": ulysses}]) is None


@pytest.mark.parametrize("argv,environ,message", [
    (["--attention-mask", "none"], {"COC_CP_MASK_TYPE": "causal"},
     "--attention-mask=none disagrees with COC_CP_MASK_TYPE=causal"),
    ([], {"RANK": "0", "WORLD_SIZE": "8"}, "--cp=2 under torchrun needs --tp (the job's tensor-parallel size)"),
    (["--tp", "2"], {"RANK": "0", "WORLD_SIZE": "6"},
     "the world size 6 (WORLD_SIZE) is invalid with --tp=2 --cp=2: expected a multiple of --tp x --cp (4)"),
])
def test_attention_errors_that_depend_on_the_environment(argv, environ, message, capsys):
    with pytest.raises(SystemExit):
        _resolve(["--shape", "attention:64,1,4,4,16", "--cp", "2", *argv], environ)
    assert message in capsys.readouterr().err


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
    (["--shape", "attention:64,1,4"], "argument --shape: 'attention:64,1,4' is invalid: expected "
                                      "attention:SEQ,BATCH,HEADS,GROUPS,DIM"),
    (["--shape", "attention:64,1,4,4,16"], "--shape attention:... needs --cp >= 2 (got --cp=1)"),
    (["--shape", "attention:60,1,4,4,16", "--cp", "4"], "--shape attention:60,1,4,4,16 is invalid: the "
                                                         "sequence 60 is not a multiple of 2 x --cp (8)"),
    (["--shape", "attention:64,1,4,4,16", "--cp", "2", "--shape", "row:8,8,8"],
     "--tp=1 is invalid: expected an integer >= 2 (TP 1 has no collective to overlap) (with --cp, TP defaults to 1"),
    (["--hidden", "32", "--ffn", "64", "--seq", "30", "--micro-batch", "1", "--heads", "4", "--cp", "2"],
     "--seq=30 is invalid: expected a multiple of 2 x --cp (4)"),
    (["--hidden", "32", "--ffn", "64", "--seq", "20", "--micro-batch", "1", "--heads", "4", "--cp", "2", "--tp", "4",
      "--sequence-parallel"], "--seq=20 is invalid: expected a multiple of --tp x --cp, with --sequence-parallel (8)"),
    (["--shape", "row:8,8,8", "--attention-mask", "none"], "--attention-mask=none is for attention shapes"),
    (["--shape", "row:8,8,8", "--recompute-activations"], "--recompute-activations is for attention shapes"),
    (["--shape", "attention:64,1,4,3,16", "--cp", "2"], "3 key/value groups do not divide 4 heads"),
    (["--shape", "attention:64,1,4,2,16", "--cp", "2", "--tp", "4"],
     "heads (4) and key/value groups (2) must be multiples of --tp (4)"),
    (["--shape", "attention:64,1,4,4,16", "--cp", "2", "--tp", "2", "--world", "6"],
     "--world=6 is invalid with --tp=2 --cp=2: expected a multiple of --tp x --cp (4)"),
    (["--hidden", "32", "--ffn", "64", "--seq", "16", "--micro-batch", "1", "--cp", "2"],
     "--cp=2 with the model dimensions needs --heads"),
])
def test_bad_arguments_name_the_option_the_value_and_what_is_allowed(argv, message, capsys, monkeypatch):
    from coc_inject.cli import main

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["tune", *argv])  # fails before any rank starts
    assert exit_.value.code == 2
    error = capsys.readouterr().err
    assert "coc-inject tune: error: " in error and message in error, error
