"""``coc-inject bench --cases attention`` end to end on loopback, tiny shapes: the JSON's structure
and the invariants that could break (no timing thresholds: this VM's timings are noise)."""

import json
import math
import statistics
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("attention")
    command = [sys.executable, "-m", "coc_inject", "bench", "--cases", "attention", "--cp", "2", "4",
               "--seq", "32", "--heads", "4", "--kv-groups", "4", "--head-dim", "8", "--reps", "2",
               "--out", str(out)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "repetition 2/2" in proc.stderr  # progress goes to stderr
    return json.loads((out / "attention.json").read_text()), proc.stdout, out


def test_every_algorithm_the_shape_allows_is_measured(bench_json):
    payload, stdout, out = bench_json
    summary = payload["summary"]
    assert set(summary) == {"CP=2", "CP=4"}
    assert list(summary["CP=2"]["variants"]) == ["ring", "ulysses", "allgather", "auto"]
    assert list(summary["CP=4"]["variants"]) == ["ring", "double-ring w=2", "ulysses", "hybrid u=2", "allgather",
                                                 "auto"]
    for case in summary.values():  # auto ran one of the fixed algorithms, chosen by the engine's tuner
        assert case["variants"]["auto"]["chosen"] in set(case["variants"]) - {"auto"}
    assert set(summary["CP=4"]["rings"]) == {"ring", "double-ring w=2"}
    for case in summary.values():
        for name, row in case["variants"].items():
            assert row["max_abs_diff_vs_allgather"] < 1e-5, name  # every algorithm computed the same output
            assert all(row[key] > 0 for key in ("forward_ms", "backward_ms", "fwd_bwd_ms", "fwd_bwd_x")), name
        assert case["variants"]["allgather"]["fwd_bwd_x"] == pytest.approx(1.0)
    for raw in payload["raw"]:  # interleaved: every variant and the C / M runs have every repetition
        assert all(len(times["forward"]) == len(times["backward"]) == 2 for times in raw["times"].values())
    assert (out / "attention.png").stat().st_size > 0
    assert "ring fwd_bwd" in stdout and "target: ring fwd+bwd >= 1.25x" in stdout
    assert "target: auto fwd+bwd within 5% of the best fixed algorithm at CP=2" in stdout


def test_compute_communication_and_ideal_are_consistent(bench_json):
    summary = bench_json[0]["summary"]
    for label, case in summary.items():
        for name, ring in case["rings"].items():
            n = ring["steps"]
            for phase in ("forward", "backward"):
                row = ring[phase]
                c, m = row["C_ms"], row["M_ms"]
                assert c > 0 and m > 0 and row["serial_ms"] == pytest.approx(c + m)
                assert row["simple_ideal_ms"] == pytest.approx(max(c, m) + min(c, m) / n)
                # An ideal never beats the longer of C and M, nor loses to doing them one after another.
                assert max(c, m) * (1 - 1e-9) <= row["simple_ideal_ms"] <= row["serial_ms"]
                if ring["window"] == 1:
                    assert row["ideal_formula"] == "step-wise"
                    assert len(row["C_steps_ms"]) == n  # one kernel step per ring position
                    # transfers: n-1 in forward (the last step computes alone), n+1 in backward (home hop)
                    assert len(row["M_steps_ms"]) == (n - 1 if phase == "forward" else n + 1), (label, phase)
                    assert sum(row["C_steps_ms"]) <= c * (1 + 1e-6)
                    floor = max(c - sum(row["C_steps_ms"]), max(row["M_steps_ms"]))
                    assert floor <= row["ideal_ms"] <= row["serial_ms"] + 1e-6
            both = ring["fwd_bwd"]
            assert both["ideal_ms"] == pytest.approx(ring["forward"]["ideal_ms"] + ring["backward"]["ideal_ms"])
            expected = (both["serial_ms"] - both["achieved_ms"]) / (both["serial_ms"] - both["ideal_ms"])
            assert both["efficiency"] == pytest.approx(expected)
            assert math.isfinite(both["efficiency"])


def test_memory_kept_for_backward(bench_json):
    summary = bench_json[0]["summary"]
    for label, case in summary.items():
        variants = case["variants"]
        cp = case["cp"]
        for name, row in variants.items():
            assert len(row["memory_bytes_per_rank"]) == cp and all(b > 0 for b in row["memory_bytes_per_rank"])
            assert row["memory_bytes"] == max(row["memory_bytes_per_rank"])
            assert row["memory_bytes"] <= variants["allgather"]["memory_bytes"], (label, name)
        # q, k, v, out (fp32, this rank's share) and the log-sum-exp: 32/cp rows of 4 heads x 8
        local = 32 // cp
        assert variants["ring"]["memory_bytes"] == 4 * (4 * local * 4 * 8) + 4 * local * 4


def test_timeline_of_one_ring_call(bench_json):
    raw = bench_json[0]["raw"][0]
    line = raw["timeline"]
    kinds = {(event["kind"], event["pass"]) for event in line["events"]}
    assert kinds == {("compute", "forward"), ("compute", "backward"), ("transfer", "forward"),
                     ("transfer", "backward")}
    for event in line["events"]:
        assert 0 <= event["start"] <= event["end"] <= line["end"]
        if event["kind"] == "transfer":
            assert event["start"] <= event["wait"] <= event["end"]
    assert sum(e["kind"] == "compute" for e in line["events"]) == 2 * raw["cp"]


@pytest.mark.parametrize("argv,message", [
    (["--cp", "3", "--seq", "64"], "--seq 64 is invalid at --cp 3"),
    (["--cp", "1"], "--cp 1 is invalid: expected a context-parallel size >= 2"),
    (["--heads", "6", "--kv-groups", "4"], "--kv-groups 4 is invalid with --heads 6"),
])
def test_bad_attention_arguments_are_clear_errors(argv, message):
    from coc_inject.bench.run import main

    with pytest.raises(SystemExit) as exit_:
        main(["--cases", "attention", *argv])
    assert message in str(exit_.value)


def test_the_kernel_and_the_sdpa_yardstick_are_reported(bench_json):
    """Every CP size names the block kernel that ran (the fused CPU one by default) and has the
    yardstick row: SDPA on the whole sequence in one process, timed in every repetition."""
    payload, stdout, _ = bench_json
    assert payload["shape"]["kernel"] == "fused" and "kernel cpu-flash" in payload["title"]
    for raw, case in zip(payload["raw"], payload["summary"].values()):
        assert raw["kernel"] == case["kernel"] == "cpu-flash"
        assert len(raw["times"]["sdpa"]["forward"]) == 2 and case["sdpa"]["fwd_bwd_ms"] > 0
        ring_over_sdpa = [r / s for r, s in zip(*(
            [f + b for f, b in zip(raw["times"][name]["forward"], raw["times"][name]["backward"])]
            for name in ("ring", "sdpa")))]
        assert case["sdpa"]["ring_over_sdpa"] == pytest.approx(statistics.median(ring_over_sdpa))
    assert "sdpa, 1 process" in stdout
