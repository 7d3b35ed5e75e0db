"""``coc-inject report`` on constructed COC_REPORT files and traces: the communication table (text and
JSON) of one report and of several ranks', the side-by-side of two (off and on) with figures computed
by hand from the rows written here, the plot's PNG, and the bad inputs' messages."""

import json
import types

import pytest

from coc_inject import cli
from coc_inject.measure import exposure, records, trace

FC2 = "decoder.layers.0.mlp.linear_fc2 | forward"


def row(collectives, nbytes, communication_s, exposed_s):
    hidden = max(0.0, communication_s - exposed_s)
    return {"collectives": collectives, "bytes": nbytes, "communication_s": communication_s, "exposed_s": exposed_s,
            "hidden_s": hidden, "hidden_pct": 100 * hidden / communication_s if communication_s else 0.0}


def summary(steps, step_s, wings, kinds, layers):
    total = row(sum(r["collectives"] for r in wings.values()), sum(r["bytes"] for r in wings.values()),
                sum(r["communication_s"] for r in wings.values()), sum(r["exposed_s"] for r in wings.values()))
    return {"step_s": step_s, "steps": steps, "total": total, "wings": wings, "collectives": kinds, "layers": layers}


def report(rank, first_step_s, total, warnings=(), traces=()):
    return {"version": 3, "rank": rank, "world_size": 2, "megatron_core": "0.19.2", "config": {"mode": "chunked"},
            "calls": {"chunked": 2, "megatron": 0}, "layers": [
                {"name": "decoder.layers.0.mlp.linear_fc2", "class": "RowParallelLinear", "shape": [64, 32, 32],
                 "route": "chunked", "chunks": 4, "backend": None, "reason": None, "calls": 2}],
            "communication": {"clock": "host", "measured_steps": [1, None],
                              "first_step": dict(total, step=1, step_s=first_step_s, steps=1),
                              "total": total, "per_step": [], "warnings": list(warnings), "traces": list(traces)}}


# Off: Megatron's TP all-reduces all exposed, 412 ms per step; the DP all-reduce half hidden. Four steps of 500 ms.
DP = row(8, 800, 0.2, 0.1)
OFF = report(0, 0.8, summary(4, 2.0, {"megatron tensor-parallel": row(40, 4_000_000, 1.648, 1.648),
                                      "megatron data-parallel": DP},
                             {"tp all_reduce": row(40, 4_000_000, 1.648, 1.648), "dp-cp all_reduce": DP},
                             {f"{FC2} | megatron tensor-parallel": row(40, 4_000_000, 1.648, 1.648),
                              "(no layer) | optimizer | megatron data-parallel": DP}))
# On: the linears' chunks, 425 ms issued, 96 exposed per step (77.4% hidden). Four steps of 400 ms.
ON = report(0, 0.9, summary(4, 1.6, {"linears": row(160, 4_000_000, 1.7, 0.384), "megatron data-parallel": DP},
                            {"tp all_reduce": row(160, 4_000_000, 1.7, 0.384), "dp-cp all_reduce": DP},
                            {f"{FC2} | linears": row(160, 4_000_000, 1.7, 0.384),
                             "(no layer) | optimizer | megatron data-parallel": DP}),
            warnings=["COC_MEASURE: linears hid 77% ..."])


def files(tmp_path, **named):
    paths = []
    for name, content in named.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(content))
        paths.append(str(path))
    return paths


def run(*argv):
    return cli.main(["report", *map(str, argv)])


def failure(*argv) -> str:
    with pytest.raises(SystemExit) as raised:
        run(*argv)
    return str(raised.value.code)


def test_one_report_prints_the_route_table_then_the_communication_table(tmp_path, capsys):
    (path,) = files(tmp_path, on=ON)
    assert run(path) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path}: rank 0/2, megatron-core 0.19.2, mode chunked")  # the route table, as before
    assert (f"{path}: communication of rank 0/2, host clock, per step over 4 measured steps (none steady): step 400.0 ms "
            "(first measured step 1: 900.0 ms)") in out
    lines = out.splitlines()
    linears = next(line for line in lines if line.strip().startswith("linears")).split()
    assert linears == ["linears", "425.00", "96.00", "77%", "40", "1.00"]  # per step: 160 / 4 collectives, 4 MB / 4
    assert next(line for line in lines if line.strip().startswith("all ")).split()[1:4] == ["475.00", "121.00", "75%"]
    assert next(line for line in lines if line.strip().startswith("dp-cp all_reduce")).split()[2:5] == [
        "50.00", "25.00", "50%"]
    assert "layers (top 2 of 2 by exposed ms; layer | phase | wing)" in out
    assert "warning: COC_MEASURE: linears hid 77% ..." in out


def test_the_json_twin_has_the_same_figures(tmp_path, capsys):
    (path,) = files(tmp_path, on=ON)
    assert run(path, "--json", "--top", "1") == 0
    (figures,) = json.loads(capsys.readouterr().out)["reports"]
    assert figures["steps"] == 4 and figures["step_ms"] == pytest.approx(400.0)
    assert figures["first_step"] == {"step": 1, "step_ms": pytest.approx(900.0)}
    linears = figures["wings"]["linears"]
    assert linears["communication_ms"] == pytest.approx(425.0) and linears["exposed_ms"] == pytest.approx(96.0)
    assert linears["hidden_pct"] == pytest.approx(100 * (1.7 - 0.384) / 1.7)
    assert [layer["layer"] for layer in figures["layers"]] == [f"{FC2} | linears"]  # --top 1: the most exposed
    assert figures["layers_total"] == 2


def test_several_ranks_reports_each_get_their_table(tmp_path, capsys):
    paths = files(tmp_path, r0=ON, r1=dict(ON, rank=1))
    assert run(*paths) == 0
    out = capsys.readouterr().out
    assert "communication of rank 0/2" in out and "communication of rank 1/2" in out
    assert "exposed ->" not in out  # two ranks of one job: no side-by-side


@pytest.mark.parametrize("how", ["automatic", "--compare"])
def test_two_reports_side_by_side(tmp_path, capsys, how):
    paths = files(tmp_path, off=OFF, on=ON)
    assert run(*paths, *(["--compare"] if how == "--compare" else [])) == 0
    out = capsys.readouterr().out
    assert f"off {paths[0]} (rank 0, 4 measured steps (none steady)) -> on {paths[1]}" in out
    assert ("step: first measured step 800.0 -> 900.0 ms (off/on 0.889x); averaged 500.0 -> 400.0 ms per step "
            "(off/on 1.250x)") in out
    assert "tp all_reduce: 412.0 ms exposed -> 96.0 ms (issued 412.0 -> 425.0 ms; hidden 0.0% -> 77.4%)" in out
    assert "dp-cp all_reduce: 25.0 ms exposed -> 25.0 ms (issued 50.0 -> 50.0 ms; hidden 50.0% -> 50.0%)" in out
    assert "megatron tensor-parallel: 412.0 ms exposed -> - (issued 412.0 -> -; hidden 0.0% -> -)" in out
    assert "linears: - exposed -> 96.0 ms (issued - -> 425.0 ms; hidden - -> 77.4%)" in out
    assert "all communication: 437.0 ms exposed -> 121.0 ms (issued 462.0 -> 475.0 ms" in out


def test_the_side_by_side_json(tmp_path, capsys):
    assert run(*files(tmp_path, off=OFF, on=ON), "--json") == 0
    figures = json.loads(capsys.readouterr().out)
    pair = figures["collectives"]["tp all_reduce"]
    assert pair["off"]["exposed_ms"] == pytest.approx(412.0) and pair["on"]["exposed_ms"] == pytest.approx(96.0)
    assert figures["wings"]["linears"]["off"] is None
    assert figures["step"]["measured_ms"] == {"off": pytest.approx(500.0), "on": pytest.approx(400.0),
                                              "speedup": pytest.approx(1.25)}
    assert list(figures["collectives"]) == ["tp all_reduce", "dp-cp all_reduce"]  # most exposed first


def test_the_command_reads_what_the_meter_writes(tmp_path, capsys):
    config = types.SimpleNamespace(measure=(1, None), trace_dir=None, trace_steps=None, measure_every=0,
                                   measure_warn=0, disabled=False)
    meter = exposure.Exposure(config)
    for step in (1, 2):
        record = records.Collective("linears", "all_reduce", "tp", 1000, None, "forward", 10.0 * step)
        record.waits, record.done = [(10.0 * step + 0.003, 10.0 * step + 0.004)], 10.0 * step + 0.004
        meter._step_done(step, [record], 10.0 * step, 10.0 * step + 0.010)
    content = dict(ON)
    content["communication"] = json.loads(json.dumps(meter.report()))
    (path,) = files(tmp_path, measured=content)
    assert run(path, "--json") == 0
    (figures,) = json.loads(capsys.readouterr().out)["reports"]
    assert figures["steps"] == 1 and figures["covered"] == "steady step 2"  # the first measured step left out
    assert figures["step_ms"] == pytest.approx(10.0)
    assert figures["wings"]["linears"]["communication_ms"] == pytest.approx(4.0)
    assert figures["wings"]["linears"]["exposed_ms"] == pytest.approx(1.0)
    assert figures["collectives"]["tp all_reduce"]["hidden_pct"] == pytest.approx(75.0)
    assert [layer["layer"] for layer in figures["layers"]] == ["(no layer) | forward | linears"]


def test_the_side_by_side_reads_the_steady_steps(tmp_path, capsys):
    """#43 item 1: a first measured step with auto's trials (and a later step with trials) must not weigh
    in the side-by-side: the steady steps' figures are compared, and the steps they cover are named."""
    def with_steady(content, steady_step_s, steps):
        content = json.loads(json.dumps(content))
        steady = json.loads(json.dumps(content["communication"]["total"]))
        steady.update(step_s=steady_step_s * len(steps), steps=len(steps))
        content["communication"].update(steady=steady, steady_steps=steps, trial_steps=[1, 4])
        return content

    paths = files(tmp_path, off=with_steady(OFF, 0.5, [2, 3, 5, 6]), on=with_steady(ON, 0.25, [2, 3, 5, 6]))
    assert run(*paths) == 0
    out = capsys.readouterr().out
    assert f"off {paths[0]} (rank 0, steady steps 2-3, 5-6) -> on" in out
    assert "averaged 500.0 -> 250.0 ms per step (off/on 2.000x)" in out


def traced_run(directory, step_ms):
    for rank in (0, 1):
        record = records.Collective("linears", "all_reduce", "tp", 1000, None, "forward", 0.001)
        record.waits, record.done = [(0.003, 0.004)], 0.004
        trace.write(directory, rank, 2, 0.0, step_ms / 1e3, [record], records.communication_times([record]), {})
    return directory


def test_plot_draws_off_and_on_side_by_side(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    off, on = traced_run(tmp_path / "off", 12.0), traced_run(tmp_path / "on", 8.0)
    png = tmp_path / "timeline.png"
    assert run("--plot", png, off, on) == 0
    assert f"wrote {png} (2 runs x 2 ranks)" in capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_from_the_traces_a_report_lists(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    traced = traced_run(tmp_path / "traces", 10.0)
    content = dict(ON, communication=dict(ON["communication"], traces=[str(traced / "step2" / "coc-trace-rank0-step2.json")]))
    png = tmp_path / "one.png"
    assert run(*files(tmp_path, r0=content), "--plot", png) == 0
    out = capsys.readouterr().out
    assert "communication of rank 0/2" in out and f"wrote {png} (1 run x 1 rank)" in out and png.exists()


def test_plot_without_matplotlib_says_why(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)
    assert run("--plot", tmp_path / "x.png", traced_run(tmp_path / "t", 10.0)) == 1
    assert "matplotlib is not installed" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_a_report_without_communication(tmp_path, capsys):
    unmeasured = dict(ON, communication=None)
    old = {key: value for key, value in ON.items() if key != "communication"}
    null, missing = files(tmp_path, null=unmeasured, missing=old)
    assert run(null) == 0  # the route table still prints, and a line says what is missing
    assert f"{null}: no communication figures ('communication' is null): the job ran without COC_MEASURE" in \
        capsys.readouterr().out
    message = failure(null, "--json")
    assert null in message and "'communication' is null" in message and "COC_MEASURE=1" in message
    message = failure(missing, "--json")
    assert missing in message and "no 'communication' section" in message
    off, = files(tmp_path, off=OFF)
    message = failure(off, null, "--compare")
    assert null in message and "'communication' is null" in message
    no_step = dict(ON, communication=dict(ON["communication"], total=None))
    message = failure(*files(tmp_path, nostep=no_step), "--json")
    assert "no measured step" in message


def test_bad_arguments_name_the_option_or_file_and_what_is_allowed(tmp_path, capsys):
    paths = files(tmp_path, a=ON, b=ON, c=ON)
    assert "--compare takes two COC_REPORT files (off, then on), got 3" in failure(*paths, "--compare")
    with pytest.raises(SystemExit):
        run(paths[0], "--plot", tmp_path / "x.jpg")
    assert "--plot='" in capsys.readouterr().err and "expected a file name ending in .png" in capsys.readouterr().err + \
        "expected a file name ending in .png"
    with pytest.raises(SystemExit):
        run(paths[0], "--top", "0")
    assert "--top='0': expected a positive integer" in capsys.readouterr().err
    traced = traced_run(tmp_path / "t", 10.0)
    assert f"{traced} is a trace (COC_TRACE): give --plot PNG" in failure(traced)
    message = failure(traced, "--plot", tmp_path / "y.png", "--step", "5")
    assert "no trace of step 5" in message and "traced steps: 2" in message
    assert "--step picks the step --plot draws" in failure(paths[0], "--step", "2")
    (other,) = files(tmp_path, other={"hello": 1})
    message = failure(other)
    assert other in message and "neither a COC_REPORT file" in message and "hello" in message
    assert "cannot read" in failure(tmp_path / "absent.json")
    (tmp_path / "empty").mkdir()
    assert "without trace files" in failure(tmp_path / "empty")


def test_plot_into_a_missing_directory_is_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "missing" / "timeline.png"
    message = failure("--plot", png, traced_run(tmp_path / "t", 10.0))
    assert message.startswith(f"coc-inject report: --plot {png}: cannot write the PNG there") and "\n" not in message
