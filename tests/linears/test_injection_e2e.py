"""The product as users run it: an unmodified script under torchrun, CoC set by environment only.

examples/tp_mlp.py knows nothing of CoC. It runs Column -> gelu -> Row (TP=2, no SP) with
seq=13, batch=2: m=26 rows, not divisible by 3, 4 or 8. Each launch is run once per module.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import RANKS, SITE, clean_env, torchrun  # noqa: E402
from scope import OLDER_RELEASE, newest_only  # noqa: E402

SCRIPT = ROOT / "examples" / "tp_mlp.py"


def launch(workdir, name, env, *script_args):
    """Run examples/tp_mlp.py; returns (CompletedProcess, per-rank saved results or None)."""
    proc = torchrun(SCRIPT, ["--out", str(Path(workdir) / f"{name}.pt"), *script_args], env, workdir)
    if proc.returncode != 0:
        return proc, None
    return proc, [torch.load(Path(workdir) / f"{name}_rank{rank}.pt") for rank in range(RANKS)]

ROWS = 13 * 2
# 1 = off (nothing patched), 3 (26 rows: uneven chunks; run at debug level), 4 (the banner). Every
# chunk count is checked against Megatron per layer in the layer suites; each launch here costs ~8 s:
# the older releases run the uneven one (the banner and N=1 are coc-inject's own, tested on the newest).
CHUNK_COUNTS = [3] if OLDER_RELEASE else [1, 3, 4]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("e2e")
    launched = {"off": launch(tmp_path, "off", clean_env())}
    for chunks in CHUNK_COUNTS:
        extra = {"COC_LOG_LEVEL": "debug"} if chunks == 3 else {}
        launched[chunks] = launch(tmp_path, f"n{chunks}", clean_env(
            PYTHONPATH=str(SITE), COC_PARALLEL_NUM=str(chunks), **extra))
    for name, (proc, _) in launched.items():
        assert proc.returncode == 0, f"run {name} failed:\n{proc.stderr[-4000:]}"
    return launched


def relative_error(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("chunks", CHUNK_COUNTS)
def test_unmodified_script_matches_unpatched(runs, chunks):
    _, reference = runs["off"]
    _, coc = runs[chunks]
    for rank in range(2):
        tensors = [key for key, value in reference[rank].items() if torch.is_tensor(value)]
        assert {"output", "input_grad", "fc1.weight.grad", "fc2.weight.grad", "fc2.bias.grad"} <= set(tensors)
        for key in tensors:
            assert relative_error(coc[rank][key], reference[rank][key]) <= 1e-5, (chunks, rank, key)


@pytest.mark.parametrize("chunks", CHUNK_COUNTS)
def test_forward_really_chunked(runs, chunks):
    _, reference = runs["off"]
    _, coc = runs[chunks]
    for rank in range(2):
        assert reference[rank]["forward_collectives"] == {"all_reduce": 1}
        if chunks == 1:  # 1 = off: nothing patched, Megatron's single all-reduce
            assert coc[rank]["forward_collectives"] == {"all_reduce": 1}
        else:
            # Row: one all-reduce per chunk (the one-time settings agreement goes through the store: no collective).
            assert coc[rank]["forward_collectives"] == {"all_reduce": min(chunks, ROWS)}
        # Column without SP keeps Megatron's own backward overlap by default.
        assert coc[rank]["backward_collectives"] == reference[rank]["backward_collectives"]


@newest_only  # the launches with N=4 and N=1 run on the newest release only
def test_banner_once_from_rank_zero(runs):
    stderr = runs[4][0].stderr
    banners = [line for line in stderr.splitlines() if "CoC installed" in line]
    assert len(banners) == 1, stderr[-3000:]
    assert banners[0].startswith("[coc-inject rank 0] CoC installed")
    for fragment in ("rank 0/2", "mode chunked", "N=4", "megatron-core 0.", "RowParallelLinear.forward"):
        assert fragment in banners[0]
    assert "CoC installed" not in runs["off"][0].stderr
    assert "CoC installed" not in runs[1][0].stderr  # N=1 is off: nothing patched, nothing said


def test_debug_level_every_rank_and_fallback_reasons(runs):
    stderr = runs[3][0].stderr
    assert "[coc-inject rank 0] CoC installed" in stderr and "[coc-inject rank 1] CoC installed" in stderr
    reasons = [line for line in stderr.splitlines() if "Megatron's own forward is used" in line]
    assert len(reasons) == 2  # the Column layer, once per rank
    assert all("COC_ENABLE_IN_COLUMN_BACKWARD=1" in line for line in reasons)


@newest_only  # coc-inject's own parsing and launcher: the same on every release
def test_bad_value_stops_training_but_not_python(tmp_path):
    env = clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM="four")
    proc, _ = launch(tmp_path, "bad", env)
    assert proc.returncode != 0
    assert "COC_PARALLEL_NUM='four' is invalid: expected an integer >= 1 (1 = off)" in proc.stderr
    unrelated = subprocess.run([sys.executable, "-c", "print(6 * 7)"], env=env, capture_output=True,
                               text=True, timeout=60)
    assert unrelated.returncode == 0 and unrelated.stdout.strip() == "42" and unrelated.stderr == ""


@newest_only  # coc-inject's own parsing and launcher: the same on every release
def test_mindspeed_flags_are_honoured_and_removed(tmp_path):
    # The script's argparse would reject the MindSpeed flags: success means they were removed.
    env = clean_env(PYTHONPATH=str(SITE))
    proc, results = launch(tmp_path, "mindspeed", env, "--use-ascend-coc", "--coc-parallel-num", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "N=4" in proc.stderr
    assert results[0]["forward_collectives"]["all_reduce"] == 4


@newest_only  # coc-inject's own parsing and launcher: the same on every release
def test_mindspeed_flag_disagreeing_with_env_is_an_error(tmp_path):
    env = clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM="2")
    proc, _ = launch(tmp_path, "disagree", env, "--use-ascend-coc", "--coc-parallel-num", "4")
    assert proc.returncode != 0
    assert "--coc-parallel-num 4 disagrees with COC_PARALLEL_NUM=2" in proc.stderr


@newest_only  # coc-inject's own parsing and launcher: the same on every release
def test_cli_run_launches_with_the_bootstrap(tmp_path):
    out = tmp_path / "cli.pt"
    command = [sys.executable, "-m", "coc_inject", "run", "3", "--", sys.executable, "-m",
               "torch.distributed.run", "--nproc-per-node", str(RANKS), "--standalone", str(SCRIPT),
               "--out", str(out)]
    proc = subprocess.run(command, env=clean_env(PYTHONPATH=str(ROOT)), cwd=tmp_path, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "N=3" in proc.stderr
    assert torch.load(tmp_path / "cli_rank0.pt")["forward_collectives"]["all_reduce"] == 3
