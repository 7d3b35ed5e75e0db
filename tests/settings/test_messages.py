"""#54: the commands' messages say the truth: status names the real reason the bootstrap will not run,
each setting is listed under one name, --help prints no reST markup, and no command prints torch's
'Failed to initialize NumPy' warning where NumPy is missing (none of them needs it)."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def command(*args, pythonpath=(), **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC_"))}
    environment.update(env, PYTHONPATH=os.pathsep.join([*map(str, pythonpath), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "coc_inject", *args], cwd=ROOT, env=environment,
                          capture_output=True, text=True, timeout=300)


def test_status_names_the_real_reason_and_each_setting_once(tmp_path):
    """Off PYTHONPATH it said 'no (python -I, -E or -S would skip it)'; it listed cp_algorithm and cp_algo.
    (Without NumPy, too: torch's warning that it is missing is not ours to print.)"""
    (tmp_path / "numpy").mkdir()  # NumPy made unimportable, as in an environment without it
    (tmp_path / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    proc = command("status", pythonpath=[tmp_path])
    assert "Failed to initialize NumPy" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    will_run = next(line for line in proc.stdout.splitlines() if line.startswith("will run"))
    assert "not on PYTHONPATH" in will_run and "-I" not in will_run, will_run
    proc = command("status", pythonpath=[ROOT / "sitecustomize"], COC_CP_ALGO="ring")
    will_run = next(line for line in proc.stdout.splitlines() if line.startswith("will run"))
    assert will_run.split(":", 1)[1].strip().startswith("yes"), will_run
    listed = [line.split()[0] for line in proc.stdout.split("configuration     :", 1)[1].splitlines()[1:]
              if line.startswith("  ") and line.split()]
    assert "cp_algorithm" in listed and "cp_algo" not in listed, listed
    assert "cp_algorithm                   ring" in proc.stdout


def helps():
    from coc_inject import cli
    from coc_inject.bench import run as bench
    from coc_inject.selftest import run as selftest
    from coc_inject.tune import run as tune

    parser = cli.build_parser()
    yield "coc-inject", parser.format_help()
    commands = next(action for action in parser._actions if action.dest == "command_name").choices
    for name, sub in commands.items():
        yield f"coc-inject {name}", sub.format_help()
    yield "coc-inject bench", bench.build_parser().format_help()
    yield "coc-inject selftest", selftest.parser().format_help()
    yield "coc-inject tune", tune.build_parser().format_help()


def test_help_prints_no_rest_markup():
    marked = [name for name, text in helps() if "``" in text or ":func:`" in text or ":class:`" in text]
    assert not marked, marked


def test_local_ranks_print_no_numpy_warning_where_numpy_is_missing(tmp_path):
    """The self-test's ranks start in processes of their own (a fork server): the filter reaches them too."""
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\")\n")
    proc = command("selftest", "--cases", "linears", "--shape", "64", "32", "48", "--chunks", "2", "--reps", "1",
                   pythonpath=[tmp_path])  # errors only, no timing bound (the meter case has one)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Failed to initialize NumPy" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
