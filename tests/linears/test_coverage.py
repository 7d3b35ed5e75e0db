"""Coverage accounting, the first-step summary, its warnings and the COC_REPORT file (issue 9).

Worker tests: real megatron-core layers on 2 gloo ranks (TP 2) in a small model, one training
step with torch.optim.SGD (the first step ends at its first optimizer step). Transformer
Engine cannot be installed: its classes are stand-ins (tests/fakes/te_layers.py).
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from coc_inject import coverage, routes
from coc_inject.config import CocConfig
from scope import newest_only

ROOT = Path(__file__).resolve().parents[2]
NAMES = {"decoder.layers.0.linear_fc1": "ColumnParallelLinear", "decoder.layers.0.linear_fc2": "RowParallelLinear"}


def by_name(report):
    return {layer["name"]: layer for layer in report["layers"]}


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_every_layer_has_its_route_chunks_and_calls(pool2, sp):
    for rank, result in enumerate(pool2.run("coverage_cases:one_step", sequence_parallel=sp, steps=2)):
        report = result["report"]
        layers = by_name(report)
        assert {name: layer["class"] for name, layer in layers.items()} == NAMES
        row = layers["decoder.layers.0.linear_fc2"]
        assert (row["route"], row["chunks"], row["calls"], row["shape"]) == ("chunked", 2, 2, [32, 32, 32])
        column = layers["decoder.layers.0.linear_fc1"]
        assert column["shape"] == [32, 32, 32] and column["calls"] == 2
        if sp:
            assert (column["route"], column["chunks"], column["reason"]) == ("chunked", 2, None)
        else:
            assert (column["route"], column["chunks"]) == ("megatron", None)
            assert "no sequence parallelism" in column["reason"]
        assert report["rank"] == rank and report["local_layers"] == 2 and report["foreign_layers"] == {}
        summary = [line for line in result["log"] if line.startswith("first step:")]
        if rank == 0:
            expected = "first step: CoC on 2 of 2" if sp else "first step: CoC on 1 of 2"
            assert len(summary) == 1 and summary[0].startswith(expected), result["log"]
            assert ("1 chunked (N=2), 1 Megatron's own" in summary[0]) is not sp
        else:
            assert summary == []  # rank 0 only at info level


def test_transformer_engine_layers_are_counted_and_warned_about(pool2):
    for rank, result in enumerate(pool2.run("coverage_cases:one_step", te=True)):
        assert result["report"]["foreign_layers"] == {
            "TEColumnParallelLinear": 2, "TELayerNormColumnParallelLinear": 1, "TERowParallelLinear": 1}
        summary, warnings = result["summary"]
        assert summary.startswith("first step: CoC on 2 of 6 TP linear layers")
        te_warnings = [w for w in warnings if "Transformer Engine" in w]
        assert len(te_warnings) == 1
        assert "2 TEColumnParallelLinear, 1 TELayerNormColumnParallelLinear, 1 TERowParallelLinear" in te_warnings[0]
        assert "--transformer-impl local" in te_warnings[0] and "--tp-comm-overlap" in te_warnings[0]
        said = [line for line in result["log"] if "Transformer Engine classes" in line]
        assert len(said) == (1 if rank == 0 else 0)
        assert set(by_name(result["report"])) == set(NAMES)  # the TE stand-ins' calls are not counted


def test_forward_replaced_after_install_is_named(pool2):
    for rank, result in enumerate(pool2.run("coverage_cases:one_step", replace_row_forward=True)):
        assert result["report"]["replaced_forwards"] == {"RowParallelLinear": "coverage_cases.other_patch"}
        said = [line for line in result["log"] if "forward was replaced" in line]
        assert len(said) == (1 if rank == 0 else 0)
        if said:
            assert "RowParallelLinear.forward was replaced after coc-inject patched it" in said[0]
            assert "coverage_cases.other_patch" in said[0] and "CoC is NOT active for RowParallelLinear" in said[0]
        layers = by_name(result["report"])
        assert set(layers) == {"decoder.layers.0.linear_fc1"}  # the replaced Row never reached CoC


def test_every_call_falling_back_is_warned_about(pool2):
    # Column without SP falls back by default; COC_CUSTOMIZED turns the Row shape off.
    options = {"customized_coc": {(32, 32, 32): 1}}
    for rank, result in enumerate(pool2.run("coverage_cases:one_step", sequence_parallel=False,
                                            config_options=options)):
        assert result["report"]["calls"] == {"chunked": 0, "fused": 0, "megatron": 2, "context-parallel": 0, "multi-copy": 0, "moe": 0}
        said = [line for line in result["log"] if "no layer call went through it" in line]
        assert len(said) == (1 if rank == 0 else 0)
        summary = result["summary"][0]
        assert "CoC on 0 of 2" in summary and "COC_CUSTOMIZED sets 1 chunk" in summary


# -- pure parts, no processes ------------------------------------------------------------------


def test_report_path_per_rank_or_rank_zero_only():
    assert coverage.report_path("/r/{rank}.json", rank=3) == "/r/3.json"
    assert coverage.report_path("/r/job.json", rank=0) == "/r/job.json"
    assert coverage.report_path("/r/job.json", rank=1) is None
    assert coverage.report_path(None, rank=0) is None


def test_qualified_names_drop_wrappers():
    root = torch.nn.Module()
    root.module = torch.nn.Module()
    root.module.module = torch.nn.Module()
    root.module.module.output_layer = leaf = torch.nn.Linear(2, 2)
    parents = {}
    for module in (root, root.module, root.module.module):
        for name, child in module._modules.items():
            parents[id(child)] = (module, name)
    assert coverage.qualified_name(leaf, parents) == "output_layer"
    assert coverage.qualified_name(root, parents) is None


def _coverage(tmp_path, report):
    return coverage.Coverage(CocConfig(parallel_num=4, report=report), {})


def test_unwritable_report_directory_is_one_warning(tmp_path, caplog, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    target = tmp_path / "missing" / "r{rank}.json"
    cov = _coverage(tmp_path, str(target))
    with caplog.at_level("WARNING", logger="coc_inject"):
        cov.arm()
        assert cov.write_report() is None  # at exit: nothing more is tried or said
    cov.disarm()
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "COC_REPORT=" in said[0] and "not writable" in said[0], said
    assert str(target.parent) in said[0]
    assert not target.parent.exists()


SCRIPT = textwrap.dedent("""
    import os, signal, sys
    from coc_inject import coverage
    from coc_inject.config import CocConfig
    cov = coverage.Coverage(CocConfig(parallel_num=4, report=sys.argv[1]), {})
    cov.arm()
    if sys.argv[2] == "raise":
        raise RuntimeError("training diverged")
    os.kill(os.getpid(), signal.SIGTERM)
""")


@newest_only  # how a process ends (atexit, SIGTERM): the same on every release
@pytest.mark.parametrize("ending,returncode", [("raise", 1), ("sigterm", -signal.SIGTERM)])
def test_report_written_when_the_job_dies(tmp_path, ending, returncode):
    path = tmp_path / "r{rank}.json"
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(path), ending], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == returncode, proc.stderr
    report = json.loads((tmp_path / "r1.json").read_text())
    assert report["rank"] == 1 and report["world_size"] == 2
    assert report["config"]["parallel_num"] == 4 and report["layers"] == []
    for key in ("megatron_core", "foreign_layers", "calls", "first_step_summarized"):
        assert key in report


ENDINGS = textwrap.dedent("""
    import os, signal, sys
    from coc_inject import coverage, log
    from coc_inject.config import CocConfig
    log.configure("info")
    cov = coverage.Coverage(CocConfig(parallel_num=4, report=sys.argv[1]), {})
    cov.arm()
    if sys.argv[2] == "raise":
        raise AssertionError("cannot use --fp16 and --bf16 together")
    if sys.argv[2] == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
""")


@newest_only  # how a process ends: the same on every release
@pytest.mark.parametrize("ending,ended_by", [("raise", "exception"), ("sigterm", "SIGTERM"), ("exit", None)])
def test_no_summary_when_the_job_ends_abnormally_before_any_layer_call(tmp_path, ending, ended_by):
    path = tmp_path / "report.json"
    env = dict(os.environ, RANK="0", WORLD_SIZE="2", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", ENDINGS, str(path), ending], env=env, capture_output=True,
                          text=True, timeout=120)
    summaries = [line for line in proc.stderr.splitlines() if "first step:" in line]
    report = json.loads(path.read_text())
    assert report["ended_by"] == ended_by and report["first_step_summarized"] == (ended_by is None)
    if ended_by is None:  # a normal end with no layer call (nothing ran through Megatron) is still said
        assert summaries == ["[coc-inject rank 0] first step: CoC on 0 of 0 TP linear layers; layer calls: none"]
        assert "no layer call went through it" in proc.stderr
    else:
        assert summaries == [] and "no layer call" not in proc.stderr, proc.stderr


@newest_only  # how a process ends: the same on every release
def test_job_raising_before_its_first_step_gets_no_summary(tmp_path):
    # The product's path: the bootstrap patches Megatron's layers at import, then the job fails in its
    # argument checks (Megatron-LM's pretrain_gpt.py with --fp16 --bf16), before any layer call.
    script = ("import megatron.core.tensor_parallel.layers\n"
              "raise AssertionError('cannot use --fp16 and --bf16 together')")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "sitecustomize"), COC_PARALLEL_NUM="4",
               COC_REPORT=str(tmp_path / "coc.json"))
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "cannot use --fp16 and --bf16 together" in proc.stderr
    assert "CoC installed" in proc.stderr, proc.stderr[-3000:]
    assert "first step:" not in proc.stderr and "0 of 0" not in proc.stderr and "no layer call" not in proc.stderr
    report = json.loads((tmp_path / "coc.json").read_text())
    assert report["ended_by"] == "exception" and not report["first_step_summarized"]
    assert report["calls"] == {"chunked": 0, "fused": 0, "megatron": 0, "context-parallel": 0, "multi-copy": 0, "moe": 0} and report["megatron_core"]


class _HalfBuilt(torch.nn.Module):
    """A layer whose construction fails before torch's Module.__init__ (as a CP setting refused there)."""

    def __init__(self):
        raise ValueError("refused before Module.__init__")


def test_a_module_left_half_built_is_skipped_and_said_in_the_report(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    kept = []  # a real job's traceback keeps the half-built object alive until exit
    original_init = _HalfBuilt.__init__

    def keep(self):
        kept.append(self)
        original_init(self)

    monkeypatch.setattr(_HalfBuilt, "__init__", keep)
    with pytest.raises(ValueError):
        _HalfBuilt()
    cov = _coverage(tmp_path, str(tmp_path / "r{rank}.json"))
    cov.arm()
    try:
        path = cov.write_report()
    finally:
        cov.disarm()
    assert path == str(tmp_path / "r0.json")
    report = json.loads((tmp_path / "r0.json").read_text())
    assert report["half_built_modules"] == {"_HalfBuilt": 1} and kept


class _Touchy:
    """Counts every attribute read on its instances (as torch.distributed.reduce_op warns on each)."""

    reads = 0

    def __getattribute__(self, name):
        type(self).reads += 1
        return object.__getattribute__(self, name)


def test_the_scan_of_live_objects_reads_no_foreign_attribute_and_warns_nothing():
    import torch.distributed

    touchy = _Touchy()
    assert torch.distributed.reduce_op is not None  # alive, as in every job that imports torch.distributed
    cov = coverage.Coverage(CocConfig(parallel_num=4), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning from the scan fails the test
        cov.inspect_model()
    assert _Touchy.reads == 0 and touchy is not None


def test_cli_report_prints_a_table(tmp_path):
    report = {"rank": 0, "world_size": 2, "megatron_core": "0.19.2", "config": {"mode": "chunked"},
              "calls": {"chunked": 3, "fused": 0, "megatron": 3, "context-parallel": 0, "multi-copy": 0, "moe": 0},
              "layers": [{"name": "decoder.layers.0.mlp.linear_fc1", "class": "ColumnParallelLinear",
                          "shape": [64, 32, 32], "route": "megatron", "chunks": None, "backend": None,
                          "reason": "no sequence parallelism", "calls": 3},
                         {"name": "decoder.layers.0.mlp.linear_fc2", "class": "RowParallelLinear",
                          "shape": [64, 32, 32], "route": "chunked", "chunks": 4, "backend": None,
                          "reason": None, "calls": 3}],
              "foreign_layers": {"TELayerNormColumnParallelLinear": 2}, "replaced_forwards": {}}
    path = tmp_path / "r0.json"
    path.write_text(json.dumps(report))
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "report", str(path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = {row.split()[0]: row for row in proc.stdout.splitlines()[2:] if row.startswith("  decoder")}
    fc1 = rows["decoder.layers.0.mlp.linear_fc1"].split()
    fc2 = rows["decoder.layers.0.mlp.linear_fc2"].split()
    assert fc1[1:] == ["ColumnParallelLinear", "[64,", "32,", "32]", "megatron", "-", "3", "no", "sequence",
                       "parallelism"]
    assert fc2[1:] == ["RowParallelLinear", "[64,", "32,", "32]", "chunked", "4", "3"]
    assert "rank 0/2, megatron-core 0.19.2, mode chunked; calls: chunked 3, fused 0, megatron 3" in proc.stdout
    assert "not seen by CoC: 2 x TELayerNormColumnParallelLinear" in proc.stdout


def test_cli_report_into_a_closed_pipe_ends_quietly(tmp_path):
    # ``coc-inject report ... | head -1``: head exits after its line; the rest of the table meets a closed pipe.
    row = {"name": "decoder.layers.0.mlp.linear_fc2", "class": "RowParallelLinear", "shape": [64, 32, 32],
           "route": "chunked", "chunks": 4, "backend": None, "reason": None, "calls": 3}
    path = tmp_path / "r0.json"
    path.write_text(json.dumps({"rank": 0, "world_size": 2, "calls": {"chunked": 3}, "layers": [row] * 20000}))
    command = f"{sys.executable} -m coc_inject report {path} | head -1"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)
    assert proc.stdout.startswith(f"{path}: rank 0/2"), proc.stdout
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.stderr == ""


def test_a_freed_layers_calls_stay_in_the_report():
    cov = coverage.Coverage(CocConfig(parallel_num=4), {})
    first = torch.nn.Linear(2, 2)
    cov.count(first, routes.Chunked(4), None, lambda layer, x: (8, 2, 2))
    second = torch.nn.Linear(2, 2)
    cov.records[id(second)] = cov.records.pop(id(first))  # as if second had been given first's id
    del first
    cov.count(second, routes.MegatronPath("why"), None, lambda layer, x: (4, 2, 2))
    report = cov.report()
    assert sorted((layer["route"], layer["calls"], layer["shape"]) for layer in report["layers"]) == [
        ("chunked", 1, [8, 2, 2]), ("megatron", 1, [4, 2, 2])]
    assert report["calls"] == {"chunked": 1, "fused": 0, "megatron": 1, "context-parallel": 0, "multi-copy": 0, "moe": 0}


def test_trial_calls_are_counted_apart_and_give_no_row_its_shape():
    # auto's trials run candidates on the job's own layers (a block's copies: half the batch) before the
    # job's first call of a shape: not the job's calls, nor its first shape (issue 33, item 8).
    from coc_inject import trial

    cov = coverage.Coverage(CocConfig(parallel_num=4), {})
    layer = torch.nn.Linear(2, 2)
    half, full = (lambda layer, x: (8, 2, 2)), (lambda layer, x: (16, 2, 2))
    with trial.isolated([layer]):
        for _ in range(3):
            cov.count(layer, routes.MegatronPath("auto chose Megatron's own path (N=1) for [8, 2, 2]"), None, half)
        cov.count(layer, routes.Chunked(4), None, half)
    assert trial.active() is False
    cov.count(layer, routes.Chunked(4), None, full)
    cov.count(layer, routes.Chunked(4), None, full)
    cov.count(layer, routes.MegatronPath("auto chose Megatron's own path (N=1) for [8, 2, 2]"), None, half)
    report = cov.report()
    assert sorted((row["route"], row["calls"], row["shape"]) for row in report["layers"]) == [
        ("chunked", 2, [16, 2, 2]), ("megatron", 1, [8, 2, 2])]  # each row: the shape of its route's first call
    assert report["calls"]["chunked"] == 2 and report["calls"]["megatron"] == 1
    assert report["trial_calls"]["megatron"] == 3 and report["trial_calls"]["chunked"] == 1
    assert sorted((row["route"], row["calls"], row["shape"]) for row in report["trials"]) == [
        ("chunked", 1, [8, 2, 2]), ("megatron", 3, [8, 2, 2])]
    line = cov.summary_line()
    assert "2 chunked (N=4), 1 Megatron's own" in line and line.endswith("apart from these, auto's trials: 1 chunked, "
                                                                        "3 megatron"), line


@newest_only
def test_flash_attention_that_never_ran_is_warned_about():
    class Attention:  # a stand-in layer: Coverage only keeps a weak reference and the class name
        pass

    layer = Attention()
    accounting = coverage.Coverage(CocConfig(flash_attn=True), {})
    accounting.count_attention(layer, routes.AttentionRoute(routes.MEGATRON_ATTENTION, 1, reason="a padding mask"))
    assert any(line.startswith("COC_FLASH_ATTN=1 but no attention call ran the fused kernel") for line in
               accounting.warnings())
    accounting.count_attention(layer, routes.AttentionRoute("local", 1, kernel="cpu-flash"))
    assert not any("COC_FLASH_ATTN" in line for line in accounting.warnings())
    assert accounting.attention_summary() == ("fused attention on 1 layers (Megatron's attention for: a padding mask; "
                                            "kernel cpu-flash): 2 calls")


def test_a_step_hook_registered_after_the_coverage_still_runs(tmp_path, monkeypatch):
    # The first-step summary once removed its global optimizer hook from inside the hook: torch then
    # failed the iteration over the global hooks ("OrderedDict mutated during iteration") for any hook
    # registered after it (COC_MEASURE's step cut, a user's).
    monkeypatch.setenv("RANK", "0")
    cov = _coverage(tmp_path, None)
    cov.arm()
    seen = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    after = register_optimizer_step_post_hook(lambda *args: seen.append(1))
    try:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        optimizer.step()
        optimizer.step()
    finally:
        after.remove()
        cov.disarm()
    assert cov.ending.summarized and seen == [1, 1]


@newest_only
def test_lines_that_misled_say_what_ran():
    """#43 item 7: a measure-only run's summary does not speak of context parallelism; sequence copies,
    which run their attention through the fused kernel themselves, do not draw COC_FLASH_ATTN's warning."""
    measuring = coverage.Coverage(CocConfig(measure=(1, None)), {})
    line = measuring.summary_line()
    assert "context parallelism" not in line and "measuring only" in line, line

    class Block:
        pass

    copies = coverage.Coverage(CocConfig(flash_attn=True, multi_copy=2), {})
    copies.count(Block(), routes.CopiesRoute(2, 2, split="sequence"), None, lambda layer, x: [])
    assert not any("COC_FLASH_ATTN" in line for line in copies.warnings())
