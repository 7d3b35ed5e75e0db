"""coc_inject.linears.ops on 2 and 4 real gloo ranks, against dense float64 math (no Megatron)."""

import pytest

OPS = ["matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul"]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_ops_tp2(pool2, op, chunks):
    rows = 14 if op == "matmul_reduce_scatter" else 13  # reduce-scatter rows must divide by TP
    for result in pool2.run("ops_cases:check_op", op=op, chunks=chunks, rows=rows):
        assert max(result.values()) <= 1e-5, result


@pytest.mark.parametrize("op", OPS)
def test_ops_tp4(pool4, op):
    rows = 12 if op == "matmul_reduce_scatter" else 5
    for result in pool4.run("ops_cases:check_op", op=op, chunks=3, rows=rows):
        assert max(result.values()) <= 1e-5, result


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("with_offset", [False, True])
def test_w8a16_matmul_all_reduce(pool2, granularity, dtype, with_offset):
    for result in pool2.run("ops_cases:check_w8a16", granularity=granularity, dtype=dtype,
                            with_offset=with_offset):
        # fp16/bf16 activations: within a few half-precision ulps of the float64 result.
        assert result["error"] <= (2.0**-6 if dtype == "bfloat16" else 2.0**-9), result


def test_bad_arguments_name_the_argument(pool2):
    messages = pool2.run("ops_cases:bad_input_messages")[0]
    assert "chunks=0 is invalid" in messages[0]
    assert "x.shape[0]=5 is invalid" in messages[1] and "multiple of the group size 2" in messages[1]
    assert "needs antiquant_scale" in messages[2]
    assert "antiquant scale shape=(3,) is invalid" in messages[3]


def test_selftest_command_checks_every_case(tmp_path):
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "coc_inject", "selftest", "--cases", "linears", "--shape", "64", "32",
                           "48", "--reps", "1", "--chunks", "3", "--json", str(tmp_path / "st.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "st.json").read_text())["cases"]
    chunked = {r["case"]: r["error"] for r in rows if r["backend"] == "chunked N=3"}
    assert set(chunked) == {"matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul", "w8a16_matmul_all_reduce"}
    assert all(error <= 1e-5 for error in chunked.values())
    assert any(r["backend"] == "fused atb" and "torch_atb is not installed" in r.get("skipped", "") for r in rows)
    assert proc.stdout.strip().splitlines()[-1].startswith("PASS")
