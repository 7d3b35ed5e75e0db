"""The interpreter bootstrap: sitecustomize chaining, the lazy Megatron trigger, env/coc.sh.

Almost everything runs in a fresh interpreter (PYTHONPATH pointing at the repo's
``sitecustomize`` directory, environment built explicitly, cwd outside the repo), because
the bootstrap only does its work at interpreter start. No test imports the real Megatron:
a tiny fake ``megatron`` package stands in where the trigger must fire.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SITE = REPO / "sitecustomize"
SITE_FILE = SITE / "sitecustomize.py"
COC_SH = REPO / "env" / "coc.sh"

from coc_inject import bootstrap  # noqa: E402  (pytest puts the checkout on sys.path)

HEAVY = ("torch", "wrapt", "megatron", "coc_inject.config", "coc_inject.settings", "coc_inject.linears.install",
         "importlib.metadata")

# Printed by child interpreters: what the bootstrap did to this process.
PROBE = textwrap.dedent(
    """
    import json, sys
    sc = sys.modules.get("sitecustomize")
    ci = sys.modules.get("coc_inject")
    print(json.dumps({
        "sitecustomize": getattr(sc, "__file__", None),
        "coc_inject": getattr(ci, "__file__", None),
        "bootstrap_imported": "coc_inject.bootstrap" in sys.modules,
        "trigger": any(type(f).__module__ == "coc_inject.bootstrap" for f in sys.meta_path),
        "triggers": sum(type(f).__module__ == "coc_inject.bootstrap" for f in sys.meta_path),
        "heavy": [m for m in HEAVY if m in sys.modules],
        "path": sys.path,
        "marker": getattr(sc, "CHAINED_MARKER", None),
    }))
    """
).replace("HEAVY", repr(HEAVY))


def _env(extra=None, pythonpath=(SITE,)):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"}
    if "HOME" in os.environ:
        env["HOME"] = os.environ["HOME"]
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    env.update(extra or {})
    return env


def run_py(code, *, cwd, env=None, pythonpath=(SITE,), flags=(), args=()):
    return subprocess.run(
        [sys.executable, *flags, "-c", code, *args],
        env=_env(env, pythonpath),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def probe(cwd, **kwargs):
    proc = run_py(PROBE, cwd=cwd, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def other_sitecustomize(tmp_path, body=None) -> Path:
    """A directory holding another sitecustomize (the one ours shadows)."""
    other = tmp_path / "other"
    if body is None:
        body = """
        import os, sys
        with open(os.environ["MARKER"], "a") as f:
            f.write("chained\\n")
        sys.path.append("/added/by/other")
        CHAINED_MARKER = "other"
        """
    write(other / "sitecustomize.py", body)
    return other


def fake_checkout(tmp_path, bootstrap_body, init_body="") -> Path:
    """A copy of our sitecustomize next to a (broken) coc_inject package; returns its site dir."""
    root = tmp_path / "checkout"
    (root / "sitecustomize").mkdir(parents=True)
    shutil.copy(SITE_FILE, root / "sitecustomize" / "sitecustomize.py")
    write(root / "coc_inject" / "__init__.py", init_body)
    write(root / "coc_inject" / "bootstrap.py", bootstrap_body)
    return root / "sitecustomize"


# --------------------------------------------------------------------------- chaining


def test_no_other_sitecustomize_starts_clean(tmp_path):
    baseline, _ = probe(tmp_path, pythonpath=None)
    assert baseline["sitecustomize"] is None, "precondition: this interpreter has its own sitecustomize"
    info, stderr = probe(tmp_path, env={"COC_PARALLEL_NUM": "4"})
    assert stderr == ""
    assert info["sitecustomize"] == str(SITE_FILE)
    assert info["trigger"] is True
    assert info["path"].count(str(SITE)) == 1


def test_chains_shadowed_sitecustomize(tmp_path):
    other = other_sitecustomize(tmp_path)
    marker = tmp_path / "marker"
    info, stderr = probe(
        tmp_path, pythonpath=(SITE, other), env={"MARKER": str(marker), "COC_PARALLEL_NUM": "4"}
    )
    assert stderr == ""
    assert marker.read_text() == "chained\n"  # ran, exactly once
    assert info["trigger"] is True  # and our bootstrap still ran
    # Like without us, sys.modules["sitecustomize"] is the other one; sys.path keeps its
    # additions and our directory is back where PYTHONPATH put it.
    assert info["sitecustomize"] == str(other / "sitecustomize.py")
    assert info["marker"] == "other"
    assert "/added/by/other" in info["path"]
    assert info["path"].index(str(SITE)) < info["path"].index(str(other))


def test_chaining_with_our_dir_listed_twice_and_a_lone_copy(tmp_path):
    other = other_sitecustomize(tmp_path)
    copy_dir = tmp_path / "copy"  # a copy of sitecustomize.py with no coc_inject next to it
    copy_dir.mkdir()
    shutil.copy(SITE_FILE, copy_dir / "sitecustomize.py")
    marker = tmp_path / "marker"
    info, stderr = probe(
        tmp_path,
        pythonpath=(copy_dir, SITE, SITE, other),
        env={"MARKER": str(marker), "COC_PARALLEL_NUM": "4"},
    )
    assert stderr == ""
    assert marker.read_text() == "chained\n"
    assert info["trigger"] is True
    # The lone copy imports whatever coc_inject the interpreter finds (an installed one, if
    # any); otherwise the chained checkout copy provides it.
    installed = run_py("import importlib.util as u; s = u.find_spec('coc_inject'); print(s.origin if s else '')",
                       cwd=tmp_path, pythonpath=()).stdout.strip()
    assert info["coc_inject"] == (installed or str(REPO / "coc_inject" / "__init__.py"))
    assert info["triggers"] == 1
    assert info["path"].count(str(SITE)) == 1  # site.py de-duplicates sys.path
    assert info["path"].count(str(copy_dir)) == 1


def test_first_of_two_bootstraps_brings_its_own_package(tmp_path):
    first = tmp_path / "first"
    (first / "sitecustomize").mkdir(parents=True)
    shutil.copy(SITE_FILE, first / "sitecustomize" / "sitecustomize.py")
    (first / "coc_inject").symlink_to(REPO / "coc_inject", target_is_directory=True)
    info, stderr = probe(tmp_path, pythonpath=(first / "sitecustomize", SITE), env={"COC_PARALLEL_NUM": "4"})
    assert stderr == ""
    assert info["trigger"] is True
    assert info["coc_inject"] == str(first / "coc_inject" / "__init__.py")
    assert info["triggers"] == 1
    assert info["sitecustomize"] == str(SITE_FILE)  # the chained one, as without the first
    assert str(first) not in info["path"]


@pytest.mark.parametrize(
    "body",
    ['raise RuntimeError("boom from other")', "import no_such_module_for_coc_tests"],
    ids=["raises", "inner-import-error"],
)
def test_chained_sitecustomize_that_fails_is_reported_like_site_py(tmp_path, body):
    other = other_sitecustomize(tmp_path, body)
    code = PROBE + "\nprint('program ran')\n"
    proc = run_py(code, cwd=tmp_path, pythonpath=(SITE, other), env={"COC_PARALLEL_NUM": "4"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("program ran\n")
    info = json.loads(proc.stdout.splitlines()[0])
    assert info["trigger"] is True
    assert info["sitecustomize"] == str(SITE_FILE)
    # Same report CPython gives when that sitecustomize runs without us in front of it.
    without_us = run_py("pass", cwd=tmp_path, pythonpath=(other,))
    assert without_us.stderr.startswith("Error in sitecustomize")
    assert proc.stderr == without_us.stderr


# --------------------------------------------------------------------------- laziness


@pytest.mark.parametrize(
    "env, trigger",
    [({}, False), ({"COC_PARALLEL_NUM": "4"}, True), ({"USE_COC_FUSED_KERNEL": "1"}, True),
     ({"COC_PARALLEL_NUM": "4", "COC_DISABLE": "1"}, False)],
    ids=["off", "chunked", "fused", "disabled"],
)
def test_nothing_heavy_is_imported_without_megatron(tmp_path, env, trigger):
    info, stderr = probe(tmp_path, env=env)
    assert stderr == ""
    assert info["heavy"] == []
    assert info["bootstrap_imported"] is True
    assert info["trigger"] is trigger
    # The checkout is importable as a package, but its root is not left on sys.path.
    assert info["coc_inject"] == str(REPO / "coc_inject" / "__init__.py")
    assert str(REPO) not in info["path"]


def test_argv_flag_requests_coc(tmp_path):
    info, _ = probe(tmp_path, args=("--use-ascend-coc",))
    assert info["trigger"] is True


def test_invalid_value_does_not_break_unrelated_program(tmp_path):
    proc = run_py("print(1)", cwd=tmp_path, env={"COC_PARALLEL_NUM": "abc"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "1\n", "")


# --------------------------------------------------------------------------- unknown names

UNKNOWN_LINE = "[coc-inject] warning: unknown variable "
# A child of the started process: the warning is said once per process tree, not again here.
CHILD = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'pass'])"


@pytest.mark.parametrize("env,code,said", [
    ({"COC_PARALLE_NUM": "4"}, "pass", ["COC_PARALLE_NUM is ignored: did you mean COC_PARALLEL_NUM?"]),
    ({"COC_PARALLE_NUM": "4", "RANK": "0"}, CHILD, ["COC_PARALLE_NUM is ignored: did you mean COC_PARALLEL_NUM?"]),
    ({"USE_COC_FUSED_KERNL": "1", "COC_PARALLEL_NUM": "4"}, "pass",
     ["USE_COC_FUSED_KERNL is ignored: did you mean USE_COC_FUSED_KERNEL?"]),
    ({"COC_ZZZ": "1"}, "pass", ["COC_ZZZ is ignored: no coc-inject variable is close to it"]),
    ({"COC_PARALLE_NUM": "4", "RANK": "1"}, "pass", []),
    ({"COC_PARALLEL_NUM": "4", "COC_CP_ALGO": "ring", "COC_SELFTEST_DEVICE": "npu", "USE_COCONUT": "1"}, "pass", []),
], ids=["typo", "typo-rank0-child", "typo-armed", "far-off", "rank1", "known"])
def test_an_unknown_variable_is_said_once_on_rank_zero(tmp_path, env, code, said):
    proc = run_py(code, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith(UNKNOWN_LINE)]
    assert [line[len(UNKNOWN_LINE):].split(" (")[0] for line in lines] == said, proc.stderr
    assert all(line.endswith("(coc-inject reference lists every variable)") for line in lines)


def test_known_names_follow_the_settings_table():
    # The bootstrap's stdlib copy of every name coc-inject reads (importing the table costs start-up time).
    from coc_inject.settings import table

    assert bootstrap.KNOWN == table.KNOWN_VARIABLES, f"paste into bootstrap.KNOWN: {table.KNOWN_VARIABLES!r}"
    assert set(bootstrap.PREFIXES) == {"COC_", "USE_COC_"}


@pytest.mark.parametrize("flag", ["-I", "-S", "-E"])
def test_isolated_modes_run_nothing_of_ours(tmp_path, flag):
    info, stderr = probe(tmp_path, flags=(flag,), env={"COC_PARALLEL_NUM": "4"})
    assert stderr == ""
    assert info["coc_inject"] is None and info["bootstrap_imported"] is False
    assert info["trigger"] is False
    assert info["sitecustomize"] != str(SITE_FILE)


# --------------------------------------------------------------------------- the trigger

FAKE_MEGATRON = {
    "megatron/__init__.py": "",
    "megatron/core/__init__.py": "from . import tensor_parallel\n",
    "megatron/core/tensor_parallel/__init__.py": "from .layers import ColumnParallelLinear\n",
    "megatron/core/tensor_parallel/layers.py": "class ColumnParallelLinear:\n    pass\n",
}

# Stand-in for the lead's coc_inject.linears.install, put in sys.modules by the child program.
STAND_IN = textwrap.dedent(
    """
    import sys, types
    calls = []
    install = types.ModuleType("coc_inject.linears.install")
    def on_layers_imported(module):
        calls.append((module.__name__, "wrapt" in sys.modules))
        if getattr(module, "FAIL", False):
            raise RuntimeError("configuration error stand-in")
    install.on_layers_imported = on_layers_imported
    sys.modules["coc_inject.linears.install"] = install
    import coc_inject.linears
    coc_inject.linears.install = install
    """
)


def fake_megatron(tmp_path) -> Path:
    lib = tmp_path / "lib"
    for rel, text in FAKE_MEGATRON.items():
        write(lib / rel, text)
    return lib


def test_trigger_hands_over_to_wrapt_on_first_megatron_import(tmp_path):
    lib = fake_megatron(tmp_path)
    code = STAND_IN + textwrap.dedent(
        """
        import coc_inject.bootstrap as b
        seen = []
        class Spy:  # sits right behind our trigger: must still be asked about "megatron"
            def find_spec(self, name, path=None, target=None):
                seen.append(name)
                return None
        sys.meta_path.insert(sys.meta_path.index(b._finder) + 1, Spy())
        before = "wrapt" in sys.modules
        import megatron.core
        import json
        print(json.dumps({"wrapt_before": before, "calls": calls, "state": b.state(),
                          "spy_saw_megatron": "megatron" in seen,
                          "spy_saw_layers": "megatron.core.tensor_parallel.layers" in seen,
                          "triggers": sum(type(f).__name__ == "_MegatronTrigger" for f in sys.meta_path)}))
        """
    )
    proc = run_py(code, cwd=tmp_path, pythonpath=(SITE, lib), env={"COC_PARALLEL_NUM": "4"})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["wrapt_before"] is False
    assert out["calls"] == [["megatron.core.tensor_parallel.layers", True]]
    assert out["state"] == {"trigger_installed": True, "trigger_fired": True,
                            "hook_registered": True, "error": None}
    assert out["spy_saw_megatron"] and out["spy_saw_layers"]
    assert out["triggers"] == 1


def test_hook_exception_fails_the_megatron_import(tmp_path):
    lib = fake_megatron(tmp_path)
    write(lib / "megatron/core/tensor_parallel/layers.py", "FAIL = True\n")
    write(lib / "megatron/core/tensor_parallel/__init__.py", "")
    code = STAND_IN + "import megatron.core.tensor_parallel.layers\n"
    proc = run_py(code, cwd=tmp_path, pythonpath=(SITE, lib), env={"COC_PARALLEL_NUM": "4"})
    assert proc.returncode == 1
    assert "RuntimeError: configuration error stand-in" in proc.stderr


def test_start_registers_at_once_when_megatron_is_already_imported(tmp_path):
    lib = fake_megatron(tmp_path)
    code = STAND_IN + textwrap.dedent(
        """
        import megatron.core  # before start(): no bootstrap on PYTHONPATH
        import coc_inject.bootstrap as b
        assert calls == [] and b.state()["trigger_installed"] is False
        b.start(); b.start()
        print(calls, b.state()["hook_registered"], b._finder)
        """
    )
    proc = run_py(code, cwd=tmp_path, pythonpath=(REPO, lib), env={"COC_PARALLEL_NUM": "4"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "[('megatron.core.tensor_parallel.layers', True)] True None\n"


def test_missing_wrapt_is_reported_and_megatron_still_imports(tmp_path):
    lib = fake_megatron(tmp_path)
    code = STAND_IN + "sys.modules['wrapt'] = None\nimport megatron.core\nprint('imported', calls)\n"
    proc = run_py(code, cwd=tmp_path, pythonpath=(SITE, lib), env={"COC_PARALLEL_NUM": "4"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "imported []\n"
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "[coc-inject] cannot install the Megatron import hook, CoC is NOT active: ")


def test_start_stop_in_process(monkeypatch):
    # Independent of whether this pytest process itself started with the bootstrap armed.
    monkeypatch.setattr(bootstrap, "_finder", None)
    monkeypatch.setattr(bootstrap, "_hook_registered", False)
    # Other test modules may have imported Megatron already (start() would then hook at once).
    for name in [name for name in sys.modules if name == "megatron" or name.startswith("megatron.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    monkeypatch.delenv("COC_DISABLE", raising=False)
    before = list(sys.meta_path)
    try:
        bootstrap.start()
        bootstrap.start()
        added = [f for f in sys.meta_path if f not in before]
        assert len(added) == 1 and sys.meta_path[0] is added[0]
        assert added[0].find_spec("numpy") is None and not added[0].fired
    finally:
        bootstrap.stop()
    assert sys.meta_path == before
    monkeypatch.setenv("COC_DISABLE", "yes")
    bootstrap.start()
    assert sys.meta_path == before


def test_start_propagates_a_configuration_error_from_an_immediate_hook(tmp_path):
    lib = fake_megatron(tmp_path)
    write(lib / "megatron/core/tensor_parallel/layers.py", "FAIL = True\n")
    write(lib / "megatron/core/tensor_parallel/__init__.py", "")
    code = STAND_IN + textwrap.dedent(
        """
        import megatron.core.tensor_parallel.layers
        import coc_inject.bootstrap as b
        try:
            b.start()
        except RuntimeError as exc:
            print("raised", exc, b.state()["hook_registered"])
        """
    )
    proc = run_py(code, cwd=tmp_path, pythonpath=(REPO, lib), env={"COC_PARALLEL_NUM": "4"})
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "raised configuration error stand-in True\n", "")


# --------------------------------------------------------------------------- requested()

CASES = [
    ({}, [], False),
    ({"COC_PARALLEL_NUM": "4"}, [], True),
    ({"COC_PARALLEL_NUM": " 4 "}, [], True),
    ({"COC_PARALLEL_NUM": "1"}, [], False),
    ({"COC_PARALLEL_NUM": " 1 "}, [], False),
    ({"COC_PARALLEL_NUM": ""}, [], False),
    ({"COC_PARALLEL_NUM": "  "}, [], False),
    ({"COC_PARALLEL_NUM": "abc"}, [], True),  # invalid: requested, so validation reports it
    ({"COC_PARALLEL_NUM": "0"}, [], True),
    ({"USE_COC_FUSED_KERNEL": "1"}, [], True),
    ({"USE_COC_FUSED_KERNEL": "TRUE"}, [], True),
    ({"USE_COC_FUSED_KERNEL": "maybe"}, [], True),  # invalid: requested
    ({"USE_COC_FUSED_KERNEL": "0"}, [], False),
    ({"USE_COC_FUSED_KERNEL": "False"}, [], False),
    ({"USE_COC_FUSED_KERNEL": " NO "}, [], False),
    ({"USE_COC_FUSED_KERNEL": "off"}, [], False),
    ({"USE_COC_FUSED_KERNEL": ""}, [], False),
    ({"COC_PARALLEL_NUM": "1", "USE_COC_FUSED_KERNEL": "0"}, [], False),
    ({"COC_PARALLEL_NUM": "4", "USE_COC_FUSED_KERNEL": "0"}, [], True),
    ({"COC_CUSTOMIZED": '{"[8, 4, 4]": 2}'}, [], True),
    ({"COC_CUSTOMIZED": ""}, [], False),
    ({"COC_CONFIG": "/etc/coc.toml"}, [], True),
    ({"COC_CONFIG": " "}, [], False),
    ({}, ["train.py", "--use-ascend-coc"], True),
    ({}, ["train.py", "--use-ascend-coc-x", "--no-use-ascend-coc", "use-ascend-coc"], False),
    ({}, ["train.py", "--coc-parallel-num", "4"], True),  # the config says it needs --use-ascend-coc
    ({}, ["train.py", "--coc-parallel-num=4"], True),
    ({}, ["train.py", "--coc-fused-kernel"], True),
    ({}, ["train.py", "--coc-fused-kernel-x", "--coc-parallel-numx=4"], False),
    ({"COC_DISABLE": "1", "COC_PARALLEL_NUM": "4"}, [], False),
    ({"COC_DISABLE": "On", "USE_COC_FUSED_KERNEL": "1"}, [], False),
    ({"COC_DISABLE": "YES"}, ["--use-ascend-coc"], False),
    ({"COC_DISABLE": "true", "COC_CONFIG": "x"}, [], False),
    ({"COC_DISABLE": "0", "COC_PARALLEL_NUM": "4"}, [], True),
    ({"COC_DISABLE": "", "COC_PARALLEL_NUM": "4"}, [], True),
    ({"COC_DISABLE": "bogus", "COC_PARALLEL_NUM": "4"}, [], True),
    ({"COC_LOG_LEVEL": "debug", "OTHER": "4"}, [], False),
    ({"COC_MOE_OVERLAP": "auto"}, [], True),
    ({"COC_MOE_OVERLAP": "Off"}, [], False),
    ({}, ["train.py", "--moe-alltoall-overlap-comm"], True),
]


@pytest.mark.parametrize("environ, argv, expected", CASES)
def test_requested_truth_table(environ, argv, expected):
    assert bootstrap.requested(environ, argv) is expected


def test_requesting_names_follow_the_settings_table():
    # The bootstrap keeps a stdlib copy of the table's names (importing the table would cost every
    # process start-up time): a row with ``arms`` or a flag needs its entry in bootstrap.py.
    from coc_inject.settings import argv, parsers, table

    expected = {row.variable: set(row.kind.off_words if row.arms == table.UNLESS_OFF else ())
                for row in table.SETTINGS if row.arms is not None}
    assert {name: set(off) for name, off in bootstrap.REQUESTING.items()} == expected
    assert set(bootstrap.ARGV_FLAGS) == {argv.USE_ASCEND_COC} | {row.flag for row in table.FLAGS}
    assert bootstrap.DISABLE == table.variable_for("disabled")
    assert (bootstrap._TRUE_WORDS, bootstrap._FALSE_WORDS) == (set(parsers.TRUE_WORDS), set(parsers.FALSE_WORDS))


# --------------------------------------------------------------------------- faults


@pytest.mark.parametrize(
    "body",
    ['raise RuntimeError("broken\\nbootstrap")', "def start():\n    raise SystemExit(3)\n",
     "def start():\n    1 / 0\n"],
    ids=["import-raises", "start-exits", "start-raises"],
)
@pytest.mark.parametrize("coc", [{}, {"COC_PARALLEL_NUM": "4"}], ids=["off", "on"])
def test_broken_sibling_package_never_breaks_python(tmp_path, body, coc):
    site = fake_checkout(tmp_path, body)
    proc = run_py("import sys; print(1, sys.path.count(%r))" % str(site.parent),
                  cwd=tmp_path, pythonpath=(site,), env=coc)
    assert proc.returncode == 0
    assert proc.stdout == "1 0\n"  # ran, and the fake checkout root is not left on sys.path
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("[coc-inject] bootstrap failed, CoC is NOT active: ")


def test_broken_package_init_never_breaks_python(tmp_path):
    site = fake_checkout(tmp_path, "def start():\n    pass\n", init_body="raise ImportError('bad init')\n")
    proc = run_py("import sys; print(1, sys.path.count(%r))" % str(site.parent),
                  cwd=tmp_path, pythonpath=(site,))
    assert (proc.returncode, proc.stdout) == (0, "1 0\n")
    assert proc.stderr == "[coc-inject] bootstrap failed, CoC is NOT active: ImportError: bad init\n"


def test_broken_package_found_on_sys_path_never_breaks_python(tmp_path):
    lonely = tmp_path / "lonely"  # a sitecustomize with no coc_inject next to it
    lonely.mkdir()
    shutil.copy(SITE_FILE, lonely / "sitecustomize.py")
    write(tmp_path / "lib" / "coc_inject" / "__init__.py", "")
    write(tmp_path / "lib" / "coc_inject" / "bootstrap.py", "raise RuntimeError('broken')\n")
    proc = run_py("print(1)", cwd=tmp_path, pythonpath=(lonely, tmp_path / "lib"),
                  env={"COC_PARALLEL_NUM": "4"})
    assert (proc.returncode, proc.stdout) == (0, "1\n")
    assert proc.stderr == "[coc-inject] bootstrap failed, CoC is NOT active: RuntimeError: broken\n"


# --------------------------------------------------------------------------- env/coc.sh

SHELLS = [s for s in ("bash", "zsh") if shutil.which(s)]


def run_sh(shell, script, *, cwd, env=None):
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    base.update(env or {})
    return subprocess.run([shell, "-c", script], env=base, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


SHOW = 'printf "%s|%s|%s|%s\\n" "${PYTHONPATH-<unset>}" "${COC_PARALLEL_NUM-<unset>}" ' \
       '"${USE_COC_FUSED_KERNEL-<unset>}" "${COC_DISABLE-<unset>}"'


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(
    "initial, expected",
    [(None, str(SITE)), ("", str(SITE)), ("/x:/y", f"{SITE}:/x:/y"),
     (f"/x:{SITE}:/y:", f"{SITE}:/x:/y:"), (f"{SITE}:{SITE}", str(SITE))],
    ids=["unset", "empty", "others", "middle", "doubled"],
)
def test_coc_sh_puts_bootstrap_on_pythonpath_once(tmp_path, shell, initial, expected):
    env = {} if initial is None else {"PYTHONPATH": initial}
    script = f"source {COC_SH} && cd / && source {COC_SH} && {SHOW}"
    proc = run_sh(shell, script, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{expected}|<unset>|<unset>|<unset>\n"
    assert proc.stderr.count("[coc-inject]") == 2
    # No variables: off, but the job's MindSpeed flags can still turn CoC on, and the message says so.
    assert proc.stderr.count("no CoC variables set: CoC is off unless the job passes the MindSpeed flags "
                             "--use-ascend-coc --coc-parallel-num N (or --coc-fused-kernel), which turn it on") == 2


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize(
    "arg, expected",
    [("4", "4|0|<unset>"), ("16", "16|0|<unset>"), ("fused", "<unset>|1|<unset>"),
     ("off", "<unset>|<unset>|1"), ("auto", "auto|0|<unset>")],
)
def test_coc_sh_arguments(tmp_path, shell, arg, expected):
    (tmp_path / "sub").mkdir()
    env = {"COC_DISABLE": "1"} if arg != "off" else {}
    proc = run_sh(shell, f"cd sub && source ../{os.path.relpath(COC_SH, tmp_path)} {arg} && {SHOW}",
                  cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{SITE}|{expected}\n"
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("arg", ["bogus", "0", "-2", "4x", "08", "ON"])
def test_coc_sh_bad_argument(tmp_path, shell, arg):
    script = f'source {COC_SH} {arg}; echo "status $?"; {SHOW}'
    proc = run_sh(shell, script, cwd=tmp_path, env={"PYTHONPATH": "/keep", "COC_PARALLEL_NUM": "2"})
    assert proc.returncode == 0
    assert proc.stdout == "status 1\n/keep|2|<unset>|<unset>\n"  # shell went on; nothing changed
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and f"'{arg}'" in lines[0]
    assert all(word in lines[0] for word in ("positive integer", "fused", "off"))


@pytest.mark.parametrize("arg, trigger", [("4", True), ("fused", True), ("off", False)])
def test_coc_sh_end_to_end(tmp_path, arg, trigger):
    script = f"source {COC_SH} {arg} 2>/dev/null && exec {sys.executable} -c {shlex.quote(PROBE)}"
    proc = run_sh("bash", script, cwd=tmp_path, env={"COC_PARALLEL_NUM": "8"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["trigger"] is trigger and info["heavy"] == []


def test_coc_sh_leaves_no_helpers_behind(tmp_path):
    proc = run_sh("bash", f"source {COC_SH} 4 2>/dev/null; set | grep -c '^_coc' ; type _coc_inject_env",
                  cwd=tmp_path)
    assert proc.stdout.splitlines()[0] == "0"
    assert proc.returncode != 0  # `type` finds no leftover function


@pytest.mark.parametrize("shell", SHELLS)
def test_coc_sh_lists_every_wings_variable_that_is_set(tmp_path, shell):
    """#54: with COC_MULTI_COPY and COC_MOE_OVERLAP set it said 'no CoC variables set: CoC is off' (it listed
    the linears' variables only)."""
    env = {"COC_MULTI_COPY": "2", "COC_MOE_OVERLAP": "auto", "COC_CP_ALGO": "ring", "COC_MEASURE": "1"}
    proc = run_sh(shell, f"source {COC_SH}", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith(
        "; COC_CP_ALGO=ring COC_MEASURE=1 COC_MOE_OVERLAP=auto COC_MULTI_COPY=2"), proc.stderr
    proc = run_sh(shell, f"source {COC_SH} auto", cwd=tmp_path, env={"COC_FLASH_ATTN": "1"})
    assert proc.stderr.strip().endswith("; COC_FLASH_ATTN=1 COC_PARALLEL_NUM=auto USE_COC_FUSED_KERNEL=0"), proc.stderr
