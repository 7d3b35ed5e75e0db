"""coc-inject tune --shape moe:...: COC_MOE_OVERLAP=auto's decision made ahead of a job, cached, and
taken from the cache by the next run; its argument errors."""

import json
import subprocess
import sys

import pytest


def tune(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "coc_inject", "tune", *argv], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_decides_caches_and_the_next_run_reads_the_cache(tmp_path):
    cache = tmp_path / "tune.json"
    argv = ["--shape", "moe:128,32,32,4,2", "--ep", "2", "--cache", str(cache), "--json"]
    first = tune(*argv, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = json.loads(first.stdout)["moe"]["rows"]
    assert [(row["source"], row["chunks"] in ("megatron", 1, 2, 4, 8)) for row in rows] == [("trials", True)]
    assert set(rows[0]["times_ms"]) == {"Megatron", "1 chunk(s)", "2 chunk(s)", "4 chunk(s)", "8 chunk(s)"}
    entries = json.loads(cache.read_text())["entries"]
    assert len(entries) == 1 and json.loads(next(iter(entries)))[0] == "moe"
    again = json.loads(tune(*argv, cwd=tmp_path).stdout)["moe"]["rows"]
    assert again[0]["source"] == "cache" and again[0]["chunks"] == rows[0]["chunks"]
    assert set(again[0]["times_ms"]) == set(rows[0]["times_ms"])


@pytest.mark.parametrize("argv,words", [
    (["--shape", "moe:128,32,32,4,2", "--shape", "row:8,8,8"], "--shape moe:... tunes in a run of its own"),
    (["--ep", "2"], "--ep=2 is for --shape moe:... shapes (none given)"),
    (["--shape", "moe:128,32,32,3,2", "--ep", "2"], "--ep (2) must divide the experts (3)"),
    (["--shape", "moe:128,32,32,4"], "moe:TOKENS,HIDDEN,FFN,EXPERTS,TOPK"),
    (["--shape", "moe:128,32,32,4,2", "--ep", "1"], "--ep=1 is invalid: expected an integer >= 2"),
])
def test_argument_errors_name_what_is_wrong(tmp_path, argv, words):
    proc = tune(*argv, cwd=tmp_path)
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
