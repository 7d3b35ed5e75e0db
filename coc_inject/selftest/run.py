"""The self-test's command line, its ranks and its report (table, JSON, exit status)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import sys

from coc_inject import __version__, log
from coc_inject.selftest import staged_p2p
from coc_inject.testbed import ranks

# The exit status: every wing checked and every case within its bound; a case out of its bound; nothing out
# of bound, but a wing (or a wing's cases) not checked here: a package missing (megatron-core), or no
# case of that wing could run on this device or world size. Usage errors exit 2 (argparse).
PASSED, FAILED, PASSED_WHAT_RAN = 0, 1, 3

WINGS = {"linears": "linears", "attention-kernels": "kernels", "context-parallel": "context_parallel",
         "multi-copy": "multi_copy", "moe": "moe", "meter": "meter"}  # --cases name -> module of coc_inject.selftest


def _wings(text: str) -> list:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in WINGS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--cases {text!r}: expected a comma-separated list of {', '.join(WINGS)}")
    return names


def parser() -> argparse.ArgumentParser:
    from coc_inject.selftest import __doc__ as doc

    parser = argparse.ArgumentParser(prog="coc-inject selftest", description=log.help_text(doc.split("\n\n")[0]))
    parser.add_argument("--cases", type=_wings, default=list(WINGS), metavar="WINGS",
                        help=f"comma-separated, default all: {','.join(WINGS)}")
    parser.add_argument("--json", metavar="PATH", help="write the whole result (versions, device, every case) here")
    parser.add_argument("--world", type=int, default=2, help="local CPU ranks without torchrun (default 2)")
    parser.add_argument("--shape", nargs=3, type=int, default=[512, 256, 256], metavar=("M", "K", "N"),
                        help="the linears' [M,K]x[K,N]")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, float32 on CPU "
                        "(the attention kernels run fp32, bf16 and fp16 whatever it says)")
    parser.add_argument("--chunks", nargs="+", type=int, default=[2, 4], help="the linears' chunk counts")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions per case")
    return parser


def _work(options, device) -> list | None:
    import torch
    import torch.distributed as dist

    from coc_inject.selftest.common import Context

    options.dtype = options.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    backend = dist.get_backend()
    gloo_on_a_device = device.type != "cpu" and backend == "gloo"  # COC_SELFTEST_DEVICE=cuda-gloo
    devices = getattr(getattr(torch, device.type, None), "device_count", lambda: 1)()
    ctx = Context(device, options.dtype, options.reps, dist.group.WORLD, dist.get_world_size(), dist.get_rank(),
                  options, shared_device=gloo_on_a_device and dist.get_world_size() > devices,
                  p2p_via_host=gloo_on_a_device)
    rows = []
    with staged_p2p.installed() if gloo_on_a_device else contextlib.nullcontext():
        for wing in options.cases:
            rows += importlib.import_module(f"coc_inject.selftest.{WINGS[wing]}").run(ctx)
    return {"rows": rows, "device": str(device), "dtype": options.dtype, "backend": backend} if ctx.rank == 0 else None


def versions() -> dict:
    """torch, torch_npu, megatron-core and coc-inject, as installed (torch_npu is never imported)."""
    from importlib import metadata

    import torch

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    from coc_inject import megatron_version

    return {"torch": torch.__version__, "torch_npu": installed("torch-npu") or installed("torch_npu"),
            "megatron_core": getattr(megatron_version.importable(), "version", None),
            "coc_inject": __version__, "python": platform.python_version(),
            "cuda": torch.version.cuda, "host": platform.node()}


def format_table(rows: list) -> str:
    lines = [f"{'wing':<17} {'case':<34} {'backend':<24} {'dtype':<8} {'max rel err':>11} {'bound':>7} "
             f"{'CoC ms':>8} {'ref ms':>8}  result"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['wing']:<17} {r['case']:<34} {r['backend']:<24} not run: {r['skipped']}")
            continue
        times = "".join(f"{t:8.2f} " if t is not None else f"{'-':>8} " for t in (r["coc_ms"], r["reference_ms"]))
        lines.append(f"{r['wing']:<17} {r['case']:<34} {r['backend']:<24} {r['dtype']:<8} {r['error']:11.2e} "
                     f"{r['bound']:7.0e} {times} {'ok' if r['passed'] else 'FAIL'}")
    return "\n".join(lines)


def failures(rows: list) -> list:
    """'wing case backend dtype: what err > bound' per failing case."""
    return [f"{r['wing']} {r['case']} [{r['backend']}, {r['dtype']}]: "
            + ", ".join(f"{what} {error:.2e}" for what, error in r["errors"].items() if not error <= r["bound"])
            + f" > {r['bound']:.0e}" for r in rows if "skipped" not in r and not r["passed"]]


def not_checked(rows: list, wings: list) -> list:
    """'wing (k of n cases)' groups by why, for the cases a missing package stopped and for each wing
    of which no case ran: ['moe (1 of 1 cases), multi-copy (3 of 4 cases): megatron-core is not
    importable', ...]; empty when every wing was checked."""
    reasons = {}  # why -> {wing: cases not checked}
    for wing in wings:
        own = [r for r in rows if r["wing"] == wing]
        ran = any("skipped" not in r for r in own)
        for r in own:
            if "missing" in r:
                why = f"{r['missing']} is not importable"
            elif not ran:  # 'world size 1: ...' -> 'world size 1'
                why = r["skipped"].split(":")[0]
            else:
                continue
            reasons.setdefault(why, {}).setdefault(wing, 0)
            reasons[why][wing] += 1
    return [", ".join(f"{wing} ({count} of {sum(r['wing'] == wing for r in rows)} cases)"
                      for wing, count in sorted(per_wing.items())) + f": {why}" for why, per_wing in reasons.items()]


def verdict(rows: list, wings: list) -> tuple:
    """(the last line, the exit status): PASSED only when every wing asked for was checked."""
    failed = failures(rows)
    checked = sum("skipped" not in r for r in rows)
    missed = not_checked(rows, wings)
    counts = f"{checked - len(failed)} of {checked} cases within their bounds, {len(rows) - checked} not run here"
    unchecked = f"; NOT CHECKED: {'; '.join(missed)}" if missed else ""
    if failed:
        return f"FAIL: {counts}{unchecked}", FAILED
    if missed:
        return f"PASSED WHAT RAN (exit {PASSED_WHAT_RAN}): {counts}{unchecked}", PASSED_WHAT_RAN
    return f"PASS: {counts}; every wing checked ({', '.join(wings)})", PASSED


def main(argv=None) -> int:
    log.quiet_numpy_warning()
    options = parser().parse_args(argv)
    setup = ranks.Setup(world=options.world, megatron=False, command="coc-inject selftest",
                        device_variable="COC_SELFTEST_DEVICE")
    result = ranks.run(setup, _work, options)
    if result is None:  # a torchrun rank other than 0
        return 0
    rows = result["rows"]
    where = f"{options.world} local CPU ranks (gloo)"
    if ranks.under_torchrun():
        where = f"torchrun, {os.environ.get('WORLD_SIZE')} ranks on {result['device']} over {result['backend']}"
        if result["backend"] == "gloo" and not result["device"].startswith("cpu"):
            where += " (a device's tensors through gloo's host copies: its CoC / ref times are no overlap's)"
    print(f"coc-inject selftest: {where}; --dtype {result['dtype']}")
    print(format_table(rows))
    failed = failures(rows)
    last_line, status = verdict(rows, options.cases)
    if options.json:
        with open(options.json, "w") as file:
            json.dump({"where": where, "device": result["device"], "dtype": result["dtype"], "versions": versions(),
                       "wings": options.cases, "passed": not failed, "failures": failed,
                       "not_checked": not_checked(rows, options.cases), "exit_status": status, "cases": rows},
                      file, indent=1)
    for line in failed:
        print(f"FAIL: {line}")
    print(last_line)
    return status


if __name__ == "__main__":
    sys.exit(main())
