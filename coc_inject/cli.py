"""``coc-inject`` / ``python -m coc_inject``: status | run | env | reference | report | bench | tune | selftest.

* ``status``: the resolved configuration (or every error in it), whether the bootstrap will
  run in Python processes started from this environment, the shadowed sitecustomize it
  chains, the megatron-core version, importable fused backends and the handled cases.
  Exits 1 on a bad configuration, so it can gate a job script.
* ``run [N|auto|fused|off] -- CMD ...``: put the bootstrap on PYTHONPATH and exec CMD
  (like ``ddtrace-run``); the optional first word sets the toggles as ``env/coc.sh`` does.
* ``env [N|auto|fused|off]``: print the shell exports, for ``eval "$(coc-inject env 4)"``.
* ``reference``: the environment-variable and config-file reference as markdown tables.
* ``report PATH ...``: the ``COC_REPORT`` files of a job as tables (per layer: route, chunks, calls, reason)
  and, where the job measured (COC_MEASURE), its communication per wing, collective and layer; two
  reports (off, on) side by side; ``--plot`` one step's timeline per rank from COC_TRACE's traces
  (coc_inject.report_view).
* ``bench [...]``: CoC vs unpatched Megatron timings (coc_inject.bench.run).
* ``tune [...]``: ``COC_PARALLEL_NUM=auto``'s (and with ``--cp``, ``COC_CP_ALGO=auto``'s) decisions for
  given shapes / model dimensions, made ahead of a job into the tune cache, and the equivalent fixed
  settings (coc_inject.tune.run).
* ``selftest [...]``: every wing against the truth on this machine's devices (coc_inject.selftest).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os
import shlex
import sys

from coc_inject import __version__, bootstrap, log



def toggles(mode: str | None) -> dict:
    """Environment for ``N`` / ``fused`` / ``off`` (None: leave the toggles alone).

    A value of None means "unset this variable".
    """
    if mode is None:
        return {}
    if mode == "off":
        return {"COC_DISABLE": "1"}
    if mode == "fused":
        return {"USE_COC_FUSED_KERNEL": "1", "COC_DISABLE": None}
    if mode == "auto" or (mode.isdigit() and int(mode) >= 1):
        return {"COC_PARALLEL_NUM": mode if mode == "auto" else str(int(mode)), "USE_COC_FUSED_KERNEL": "0",
                "COC_DISABLE": None}
    raise SystemExit(f"coc-inject: mode={mode!r} is invalid: expected a positive integer N (chunk count), "
                     "'auto', 'fused' or 'off'")


def pythonpath_with_bootstrap(current: str | None, site_dir: str) -> str:
    entries = [entry for entry in (current or "").split(os.pathsep) if entry and entry != site_dir]
    return os.pathsep.join([site_dir, *entries])


def _site_dir_or_exit() -> str:
    site_dir = bootstrap.bootstrap_dir()
    if site_dir is None:
        raise SystemExit("coc-inject: cannot find the bootstrap directory (sitecustomize.py) of this install")
    return site_dir


def _environment_for(mode: str | None) -> dict:
    changes = toggles(mode)
    changes["PYTHONPATH"] = pythonpath_with_bootstrap(os.environ.get("PYTHONPATH"), _site_dir_or_exit())
    return changes


def cmd_env(args) -> int:
    for name, value in _environment_for(args.mode).items():
        print(f"unset {name}" if value is None else f"export {name}={shlex.quote(value)}")
    return 0


def cmd_run(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    mode = None
    if command and command[0] not in ("--",) and (command[0] in ("fused", "off", "auto") or command[0].isdigit()):
        mode, command = command[0], command[1:]
        command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise SystemExit("coc-inject run: no command given (usage: coc-inject run [N|auto|fused|off] -- CMD ...)")
    for name, value in _environment_for(mode).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        os.execvp(command[0], command)
    except OSError as error:
        raise SystemExit(f"coc-inject run: cannot execute {command[0]!r}: {error}") from None


def _shadowed_sitecustomize(site_dir: str) -> str | None:
    others = [entry for entry in sys.path if os.path.abspath(entry or ".") != site_dir]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    return spec.origin if spec is not None else None


def _bootstrap_report(site_dir: str | None) -> list[str]:
    lines = []
    on_path = site_dir is not None and site_dir in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    lines.append(f"bootstrap dir     : {site_dir or 'NOT FOUND'}")
    lines.append(f"on PYTHONPATH     : {'yes' if on_path else 'no  (source env/coc.sh, or use coc-inject run)'}")
    skipped = [flag for flag, on in (("-I", sys.flags.isolated), ("-E", sys.flags.ignore_environment),
                                     ("-S", sys.flags.no_site)) if on]
    if skipped:
        lines.append(f"will run          : NO in this interpreter: started with {' '.join(skipped)}, which "
                     "skips PYTHONPATH/site, so the bootstrap never runs")
    elif on_path:
        lines.append("will run          : yes (unless a job starts Python with -I, -E or -S, which skip it)")
    else:  # the reason is the path, not the interpreter's flags
        lines.append("will run          : no: the bootstrap dir is not on PYTHONPATH (source env/coc.sh, "
                     "eval \"$(coc-inject env)\" or coc-inject run -- CMD)")
    requested = bootstrap.requested()
    lines.append(f"CoC requested     : {'yes' if requested else 'no'} (by the environment / command line)")
    if site_dir is not None:
        lines.append(f"chains            : {_shadowed_sitecustomize(site_dir) or 'no other sitecustomize'}")
    return lines


def cmd_status(args) -> int:
    from coc_inject import config as config_module
    from coc_inject import megatron_version

    print(f"coc-inject {__version__} (python {sys.version.split()[0]}, {sys.executable})")
    for line in _bootstrap_report(bootstrap.bootstrap_dir()):
        print(line)

    errors = config_module.validate_all()
    allow_untested = not errors and config_module.load_config().allow_untested_megatron
    print(megatron_report(megatron_version.importable(), allow_untested))
    from coc_inject.linears.fused import registry

    for name, why_not in registry.status().items():
        print(f"fused {name:<11} : {'usable' if why_not is None else 'not usable: ' + why_not}")
    preference = "auto" if errors else config_module.load_config().attn_kernel
    for line in attention_kernel_lines(preference):
        print(line)
    print("configuration     :", "INVALID" if errors else "ok")
    for error in errors:
        print(f"  error: {error}")
    if not errors:
        for key, value in config_module.load_config().describe().items():
            print(f"  {key:<30} {value}")
    if not errors and config_module.load_config().trace_dir is not None:
        from coc_inject.measure import trace

        problem = trace.unwritable(config_module.load_config().trace_dir)
        if problem is not None:
            print(f"  warning: {problem}")
    unknown = config_module.unknown_variables()
    if unknown:
        print(f"  warning: unknown variables (typo?): {', '.join(unknown)}")

    from coc_inject.linears.adapters import CASES

    print("cases handled     :")
    for case in CASES:
        print(f"  {case.layer:<21} {case.mode:<6} fwd: {case.forward}; bwd: {case.backward} [{case.schedule.value}]")
    print("multi-copy        : " + multi_copy_status(None if errors else config_module.load_config()))
    print("MoE               : " + moe_status(None if errors else config_module.load_config()))
    return 1 if errors else 0


def moe_status(config) -> str:
    """What COC_MOE_OVERLAP does in this configuration, in one line."""
    from coc_inject.moe.guards import WITHOUT_PIECES

    if config is None or not config.moe_armed:
        return "off (COC_MOE_OVERLAP=0)"
    how = "or Megatron's dispatcher, as each layer shape's trials find fastest (auto)" if config.moe_overlap == "auto" \
        else "at least 8 per layer (COC_MOE_OVERLAP=1)"
    return (f"the alltoall dispatcher's all-to-alls in pieces per local expert, pipelined against the experts, "
            f"{how}; Megatron's dispatcher for: {', '.join(WITHOUT_PIECES)}")


def multi_copy_status(config) -> str:
    """What COC_MULTI_COPY does in this configuration, in one line."""
    from coc_inject.config import AUTO
    from coc_inject.multi_copy.splits import WITHOUT_COPIES

    if config is None or not config.multi_copy_armed:
        return "off (COC_MULTI_COPY=1)"
    copies = ("2 or 4 copies (those dividing the micro-batch) or none, as the block's trials find fastest (auto)"
              if config.multi_copy == AUTO else f"{config.multi_copy} copies")
    if config.tunes_linears and config.multi_copy != AUTO:
        copies += ", the trials also deciding whether the linears in the copies chunk (COC_PARALLEL_NUM=auto)"
    return (f"TransformerBlock calls as {copies}, split along the batch (along the sequence where the micro-batch "
            "does not divide: copy 0 the first positions, the copies meeting in the attention), taking turns at their "
            "collectives "
            f"(the backward from autograd's thread, interleaved at the cuts); Megatron's block for: {', '.join(WITHOUT_COPIES)}")


def megatron_report(megatron, allow_untested: bool) -> str:
    """The megatron-core lines of ``status`` for a :class:`coc_inject.megatron_version.Megatron`
    (None: not importable): version, where it comes from, tested / untested / unsupported, guards."""
    from coc_inject import megatron_version as mv
    from coc_inject.linears.guards import GUARDS

    if megatron is None:
        return "megatron-core     : not found (import megatron.core would fail on this sys.path)"
    tested = mv.tested_range()
    why = {
        mv.TESTED: f"tested (range {tested})",
        mv.UNTESTED: f"UNTESTED, patched anyway (COC_ALLOW_UNTESTED_MEGATRON=1; tested: {tested})",
        mv.UNSUPPORTED: f"unsupported, layers left unpatched (tested: {tested}; COC_ALLOW_UNTESTED_MEGATRON=1 "
                        "tries it)",
        mv.UNKNOWN: f"release unknown, layers left unpatched (tested: {tested}; COC_ALLOW_UNTESTED_MEGATRON=1 "
                    "tries it)",
    }[mv.support(megatron.version, allow_untested)]
    installed = mv.release(megatron.version)
    lines = [f"megatron-core     : {megatron.version or 'version unknown'} {why}",
             f"  from            : {megatron.origin()}"]
    if installed is None:
        lines.append(f"  unknown because : {megatron.unknown_why()}")
    lines.append(f"guards            : a call using one of these goes to Megatron's own forward, or CoC handles "
                 f"it as Megatron does ([x]: megatron-core {megatron.version} has the feature)")
    for guard in GUARDS:
        since = ".".join(map(str, guard.since))
        present = installed is not None and installed >= guard.since
        lines.append(f"  [{'x' if present else ' '}] {guard.feature} (since {since}): {guard.handling}")
    return "\n".join(lines)


def attention_kernel_lines(preference: str) -> list:
    """Which block kernel coc-inject's attention runs here (COC_ATTN_KERNEL), per device and dtype."""
    import torch

    from coc_inject import attention_kernels

    lines = []
    for device in attention_kernels.devices_here():
        for dtype in (torch.float32, torch.bfloat16):
            try:
                choice = attention_kernels.choose(preference, device, dtype, 128)
                text = choice.name + (f" ({choice.fallback_reason})" if choice.fallback_reason else "")
            except attention_kernels.KernelUnavailable as exc:
                text = f"none: {exc}"
            lines.append(f"attention kernel  : {device} {str(dtype).removeprefix('torch.')}, head dim 128 -> {text}")
    return lines


def reference_markdown() -> str:
    """The README's variable and config-file tables, rendered from the config module."""
    from coc_inject.config import ENV_REFERENCE, FILE_REFERENCE

    def table(title, settings):
        rows = [f"| {title} | default | allowed | meaning |", "|---|---|---|---|"]
        rows += [f"| `{s.name}` | {s.default} | {s.allowed} | {s.meaning} |" for s in settings]
        return "\n".join(rows)

    return table("variable", ENV_REFERENCE) + "\n\n" + table("`COC_CONFIG` key", FILE_REFERENCE)


def report_table(reports: list) -> str:
    """``coc-inject report``: one block per report file, one row per layer and route."""
    blocks = []
    for path, report in reports:
        calls = report.get("calls", {})
        head = (f"{path}: rank {report.get('rank')}/{report.get('world_size')}, megatron-core "
                f"{report.get('megatron_core')}, mode {report.get('config', {}).get('mode')}; calls: "
                + ", ".join(f"{route} {n}" for route, n in calls.items()))
        rows = [("layer", "class", "[m, k, n]", "route", "chunks", "calls", "backend / reason / CP algorithm")]
        for layer in report.get("layers", []):
            rows.append((layer["name"], layer["class"], str(layer["shape"]), layer["route"],
                         "-" if layer["chunks"] is None else str(layer["chunks"]), str(layer["calls"]),
                         f"{layer['algorithm']}, CP={layer['cp_size']}, kernel {layer.get('kernel') or '-'}"
                         + (f": {layer['reason']}" if layer.get("reason") else "") if "algorithm" in layer
                         else layer["backend"] or layer["reason"] or ""))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
        lines = [head] + ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1]
                          for row in rows]
        for name, count in report.get("foreign_layers", {}).items():
            lines.append(f"  not seen by CoC: {count} x {name}")
        for name, origin in report.get("replaced_forwards", {}).items():
            lines.append(f"  {name}.forward replaced by {origin}: CoC not active for it")
        trials = {route: n for route, n in report.get("trial_calls", {}).items() if n}
        if trials:
            lines.append("  apart from these, auto's trials: " + ", ".join(f"{route} {n}" for route, n in trials.items()))
        for name, count in report.get("half_built_modules", {}).items():
            lines.append(f"  construction failed (see the job's error): {count} x {name}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def cmd_report(args) -> int:
    from coc_inject.report_view import command

    return command.run(args, report_table)


def cmd_reference(args) -> int:
    print(reference_markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coc-inject", description=log.help_text(__doc__.split("\n\n")[0]))
    parser.add_argument("--version", action="version", version=f"coc-inject {__version__}")
    commands = parser.add_subparsers(dest="command_name", required=True)
    commands.add_parser("status", help="show configuration, bootstrap and backends").set_defaults(func=cmd_status)
    run = commands.add_parser("run", help="run a command with the bootstrap on PYTHONPATH")
    run.add_argument("command", nargs=argparse.REMAINDER, help="[N|auto|fused|off] -- CMD ...")
    run.set_defaults(func=cmd_run)
    env = commands.add_parser("env", help="print shell exports")
    env.add_argument("mode", nargs="?", help="N (chunk count) | auto | fused | off")
    env.set_defaults(func=cmd_env)
    commands.add_parser("reference", help="print the variable reference (markdown)").set_defaults(func=cmd_reference)
    report = commands.add_parser("report", help="print COC_REPORT files as tables (routes, communication), two side "
                                 "by side, or --plot COC_TRACE's timelines")
    from coc_inject.report_view import command as report_command

    report_command.add_arguments(report)
    report.set_defaults(func=cmd_report)
    # Parsed by coc_inject.bench.run itself (see main()); listed here for --help.
    commands.add_parser("bench", help="benchmark CoC vs unpatched Megatron (coc-inject bench -h)")
    commands.add_parser("tune", help="pre-tune COC_PARALLEL_NUM=auto (and, with --cp, COC_CP_ALGO=auto) for shapes "
                        "/ model dimensions into the tune cache; prints the equivalent fixed settings "
                        "(coc-inject tune -h)")
    commands.add_parser("selftest", help="every wing against the truth on your devices (coc-inject selftest -h)")
    commands.add_parser("lab", help="every wing off and on over a parallel group emulated in one process, at an "
                        "interconnect's speed (coc-inject lab -h)")
    return parser


def main(argv=None) -> int:
    log.quiet_numpy_warning()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        from coc_inject.bench.run import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["tune"]:
        from coc_inject.tune.run import main as tune_main

        return tune_main(argv[1:])
    if argv[:1] == ["selftest"]:
        from coc_inject.selftest.run import main as selftest_main

        return selftest_main(argv[1:])
    if argv[:1] == ["lab"]:
        from coc_inject.lab.command import main as lab_main

        return lab_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, so that a closed pipe is caught below and not at interpreter exit
        return code
    except BrokenPipeError:  # ``coc-inject report ... | head``: the reader has all it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's final flush of stdout then goes nowhere
        return 1
