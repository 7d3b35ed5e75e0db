"""Start-up without __pycache__: the bootstrap's byte-code cache, and the start-up benchmark.

Where nothing may write a ``__pycache__`` next to the bootstrap (PYTHONDONTWRITEBYTECODE, a
read-only checkout), ``sitecustomize.py`` imports ``coc_inject`` and ``coc_inject.bootstrap``
with their byte code redirected to a per-user cache (COC_CACHE_DIR). Each test works on a copy
of the bootstrap made as the benchmark makes it (``copy_bootstrap``: sources only), run in a
fresh interpreter; ``python -v`` says where each code object came from.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from coc_inject.bench import startup

REPO = Path(__file__).resolve().parents[2]
SITE_FILE = REPO / "sitecustomize" / "sitecustomize.py"
TAG = sys.implementation.cache_tag

PROBE = textwrap.dedent(
    """
    import json, sys
    import coc_inject, coc_inject.bootstrap as b
    print(json.dumps({
        "init_cached": coc_inject.__spec__.cached,
        "bootstrap_cached": b.__spec__.cached,
        "init_file": coc_inject.__file__,
        "trigger": any(type(f).__module__ == "coc_inject.bootstrap" for f in sys.meta_path),
        "pycache_prefix": sys.pycache_prefix,
        "dont_write_bytecode": sys.dont_write_bytecode,
        "mark": getattr(b, "MARK", None),
    }))
    """
)


@pytest.fixture()
def copy(tmp_path):
    """A byte-code-free copy of the bootstrap; returns its root (``sitecustomize/``, ``coc_inject/``)."""
    startup.copy_bootstrap(tmp_path / "checkout")
    return tmp_path / "checkout"


def run_py(root, *, cache=None, nopyc=True, flags=(), code=PROBE, env=None, cwd=None):
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8",
            "HOME": str(root.parent / "home"), "PYTHONPATH": str(root / "sitecustomize"),
            "COC_PARALLEL_NUM": "4"}
    if nopyc:
        base["PYTHONDONTWRITEBYTECODE"] = "1"
    if cache is not None:
        base["COC_CACHE_DIR"] = str(cache)
    base.update(env or {})
    return subprocess.run([sys.executable, *flags, "-c", code], env=base, cwd=cwd or root.parent,
                          capture_output=True, text=True, timeout=120)


def probe(root, **kwargs):
    proc = run_py(root, **kwargs)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


def code_sources(stderr: str) -> dict:
    """``python -v``: where the code object of coc_inject's __init__ and bootstrap came from."""
    found = {}
    for line in stderr.splitlines():
        if line.startswith("# code object from ") and "coc_inject" in line:
            origin = line[len("# code object from "):].strip("'")
            found[Path(origin).name.split(".")[0]] = origin
    return found


def pycaches(root: Path) -> list:
    return sorted(str(p.relative_to(root)) for p in root.rglob("__pycache__"))


def cached_pyc(cache: Path, root: Path, name: str) -> Path:
    """Where importlib keeps ``root/coc_inject/<name>.py``'s byte code under pycache_prefix ``cache``."""
    return cache / str(root / "coc_inject").lstrip(os.sep) / f"{name}.{TAG}.pyc"


# --------------------------------------------------------------------------- the cache


def test_first_start_fills_the_cache_and_later_starts_use_it(copy, tmp_path):
    cache = tmp_path / "cache"
    info, stderr = probe(copy, cache=cache)
    assert stderr == ""
    assert info["trigger"] is True
    assert info["init_file"] == str(copy / "coc_inject" / "__init__.py")
    pycs = {name: cached_pyc(cache, copy, name) for name in ("__init__", "bootstrap")}
    assert info["init_cached"] == str(pycs["__init__"]) and info["bootstrap_cached"] == str(pycs["bootstrap"])
    assert all(p.is_file() for p in pycs.values())
    assert sorted(str(p.relative_to(cache)) for p in cache.rglob("*.pyc")) == sorted(
        str(p.relative_to(cache)) for p in pycs.values())  # nothing else goes there
    assert pycaches(copy) == []  # PYTHONDONTWRITEBYTECODE still holds next to the sources
    # Only the bootstrap's own import was redirected: the program sees the flags as set.
    assert info["pycache_prefix"] is None and info["dont_write_bytecode"] is True

    stamps = {name: (p.stat().st_ino, p.stat().st_mtime_ns) for name, p in pycs.items()}
    proc = run_py(copy, cache=cache, flags=("-v",))
    assert proc.returncode == 0
    assert code_sources(proc.stderr) == {name: str(p) for name, p in pycs.items()}  # not compiled
    assert {name: (p.stat().st_ino, p.stat().st_mtime_ns) for name, p in pycs.items()} == stamps
    assert json.loads(proc.stdout)["trigger"] is True


def test_changed_source_is_recompiled_and_cached_again(copy, tmp_path):
    cache = tmp_path / "cache"
    probe(copy, cache=cache)
    source = copy / "coc_inject" / "bootstrap.py"
    source.write_text(source.read_text() + "\nMARK = 'edited'\n")
    proc = run_py(copy, cache=cache, flags=("-v",))
    assert proc.returncode == 0
    assert code_sources(proc.stderr)["bootstrap"] == str(source)  # the stale byte code was not used
    assert json.loads(proc.stdout)["mark"] == "edited"
    proc = run_py(copy, cache=cache, flags=("-v",))
    assert code_sources(proc.stderr)["bootstrap"] == str(cached_pyc(cache, copy, "bootstrap"))
    assert json.loads(proc.stdout)["mark"] == "edited"


def test_existing_pycache_is_used_and_the_cache_left_alone(copy, tmp_path):
    cache = tmp_path / "cache"
    info, _ = probe(copy, cache=cache, nopyc=False)  # writable copy: Python writes __pycache__ itself
    assert info["bootstrap_cached"] == str(copy / "coc_inject" / "__pycache__" / f"bootstrap.{TAG}.pyc")
    proc = run_py(copy, cache=cache, flags=("-v",))  # now with PYTHONDONTWRITEBYTECODE
    assert set(code_sources(proc.stderr).values()) == {
        str(copy / "coc_inject" / "__pycache__" / f"{name}.{TAG}.pyc") for name in ("__init__", "bootstrap")}
    assert not cache.exists()


def test_optimized_byte_code_is_told_apart(copy, tmp_path):
    cache = tmp_path / "cache"
    probe(copy, cache=cache, nopyc=False, flags=("-O",))  # writes only the .opt-1 files
    info, _ = probe(copy, cache=cache, flags=("-O",))
    assert info["bootstrap_cached"].endswith(f"__pycache__/bootstrap.{TAG}.opt-1.pyc")
    assert not cache.exists()
    info, _ = probe(copy, cache=cache)  # without -O there is no byte code next to the sources
    assert info["bootstrap_cached"] == str(cached_pyc(cache, copy, "bootstrap"))


def test_user_pycache_prefix_wins(copy, tmp_path):
    cache, prefix = tmp_path / "cache", tmp_path / "prefix"
    info, stderr = probe(copy, cache=cache, nopyc=False, env={"PYTHONPYCACHEPREFIX": str(prefix)})
    assert stderr == "" and info["pycache_prefix"] == str(prefix)
    assert info["bootstrap_cached"].startswith(str(prefix) + os.sep)
    assert not cache.exists()


def test_flags_are_restored_when_the_import_fails(copy, tmp_path):
    (copy / "coc_inject" / "bootstrap.py").write_text("raise RuntimeError('broken')\n")
    code = "import sys; print(sys.pycache_prefix, sys.dont_write_bytecode, 'coc_inject.bootstrap' in sys.modules)"
    proc = run_py(copy, cache=tmp_path / "cache", code=code)
    assert (proc.returncode, proc.stdout) == (0, "None True False\n")
    assert proc.stderr == "[coc-inject] bootstrap failed, CoC is NOT active: RuntimeError: broken\n"


@pytest.mark.parametrize("where", ["under-a-file", "off", "relative"])
def test_unusable_cache_dir_starts_cleanly(copy, tmp_path, where):
    (tmp_path / "a-file").write_text("")
    value = {"under-a-file": str(tmp_path / "a-file" / "cache"), "off": "off", "relative": "cache"}[where]
    work = tmp_path / "work"
    work.mkdir()
    proc = run_py(copy, cache=value, cwd=work, flags=("-v",))
    assert proc.returncode == 0 and "[coc-inject]" not in proc.stderr
    assert json.loads(proc.stdout)["trigger"] is True
    assert code_sources(proc.stderr)["bootstrap"] == str(copy / "coc_inject" / "bootstrap.py")  # from source
    assert list(work.iterdir()) == [] and pycaches(copy) == []
    quiet = run_py(copy, cache=value, cwd=work)
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_default_cache_dir_is_under_the_user_cache(copy, tmp_path):
    info, stderr = probe(copy, env={"HOME": str(tmp_path / "home")})
    assert stderr == ""
    assert info["bootstrap_cached"] == str(cached_pyc(tmp_path / "home/.cache/coc-inject/pycache", copy, "bootstrap"))
    info, _ = probe(copy, env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert info["bootstrap_cached"] == str(cached_pyc(tmp_path / "xdg/coc-inject/pycache", copy, "bootstrap"))


def test_read_only_checkout_uses_the_cache(copy, tmp_path):
    """No PYTHONDONTWRITEBYTECODE, but nothing can be written next to the sources: as root, a
    read-only bind mount in a private mount namespace (root writes through permission bits);
    otherwise, directories without write permission."""
    cache = tmp_path / "cache"
    code = PROBE + "import os; print(os.access(%r, os.W_OK))\n" % str(copy / "coc_inject")
    if os.geteuid() == 0:
        if not shutil.which("unshare"):
            pytest.skip("root without unshare(1): cannot make a read-only directory")
        script = ('mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$1" -c "$2"')
        base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path / "home"),
                "PYTHONPATH": str(copy / "sitecustomize"), "COC_PARALLEL_NUM": "4", "COC_CACHE_DIR": str(cache)}
        proc = subprocess.run(["unshare", "-m", "sh", "-c", script, str(copy), sys.executable, code],
                              env=base, capture_output=True, text=True, timeout=120)
        if proc.returncode != 0 and "mount" in proc.stderr:
            pytest.skip(f"no private read-only mount here: {proc.stderr.strip()}")
    else:
        for directory in (copy / "coc_inject", copy / "sitecustomize"):
            directory.chmod(0o555)
        try:
            proc = run_py(copy, cache=cache, nopyc=False, code=code)
        finally:
            for directory in (copy / "coc_inject", copy / "sitecustomize"):
                directory.chmod(0o755)
    assert (proc.returncode, proc.stderr) == (0, "")
    info = json.loads(proc.stdout.splitlines()[0])
    assert proc.stdout.splitlines()[1] == "False"  # really read-only
    assert info["trigger"] is True
    assert info["bootstrap_cached"] == str(cached_pyc(cache, copy, "bootstrap"))
    assert info["dont_write_bytecode"] is False and pycaches(copy) == []


# --------------------------------------------------------------------------- _cache_dir, in process


@pytest.fixture()
def cache_dir(monkeypatch):
    """sitecustomize.py's ``_cache_dir``, compiled on its own (the module runs the bootstrap on import)."""
    tree = ast.parse(SITE_FILE.read_text())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_cache_dir")
    namespace = {"os": os, "sys": sys}
    exec(compile(ast.Module(body=[node], type_ignores=[]), str(SITE_FILE), "exec"), namespace)
    for name in ("COC_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPYCACHEPREFIX"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", "/home/u")
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    return namespace["_cache_dir"]


DEFAULT = "/home/u/.cache/coc-inject/pycache"


@pytest.mark.skipif(sys.flags.optimize != 0, reason="the names below are those without -O")
@pytest.mark.parametrize(
    "setup, expected",
    [
        ({}, DEFAULT),
        ({"env": {"COC_CACHE_DIR": "/c"}}, "/c"),
        ({"env": {"COC_CACHE_DIR": "off"}}, None),
        ({"env": {"COC_CACHE_DIR": ""}}, DEFAULT),  # empty = unset
        ({"env": {"XDG_CACHE_HOME": "/x"}}, "/x/coc-inject/pycache"),
        ({"env": {"XDG_CACHE_HOME": "x"}}, DEFAULT),  # relative: ignored
        ({"env": {"HOME": ""}}, None),
        ({"env": {"HOME": "", "XDG_CACHE_HOME": "/x"}}, "/x/coc-inject/pycache"),
        ({"pycache_prefix": "/p"}, None),
        ({"cache_tag": None}, None),  # an interpreter that keeps no byte code
        ({"dont_write": False}, None),  # writable: Python writes __pycache__ itself
        ({"dont_write": False, "writable": False}, DEFAULT),
        ({"pycs": ("__init__", "bootstrap")}, None),
        ({"pycs": ("bootstrap",)}, DEFAULT),
        ({"pycs": ("__init__", "bootstrap"), "dont_write": False, "writable": False}, None),
    ],
)
def test_cache_dir_decision(cache_dir, monkeypatch, tmp_path, setup, expected):
    package = tmp_path / "coc_inject"
    (package / "__pycache__").mkdir(parents=True)
    for name in setup.get("pycs", ()):
        (package / "__pycache__" / f"{name}.{TAG}.pyc").write_bytes(b"")
    for name, value in setup.get("env", {}).items():
        monkeypatch.setenv(name, value)
    if "cache_tag" in setup:
        monkeypatch.setattr(sys.implementation, "cache_tag", setup["cache_tag"])
    if "pycache_prefix" in setup:
        monkeypatch.setattr(sys, "pycache_prefix", setup["pycache_prefix"])
    if "dont_write" in setup:
        monkeypatch.setattr(sys, "dont_write_bytecode", setup["dont_write"])
    if not setup.get("writable", True):
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert cache_dir(str(package)) == expected


# --------------------------------------------------------------------------- the benchmark


def test_bench_copy_is_the_checkout_sources_only(tmp_path):
    site = startup.copy_bootstrap(tmp_path)
    assert site == tmp_path / "sitecustomize"
    assert (site / "sitecustomize.py").read_bytes() == SITE_FILE.read_bytes()
    ours = sorted(str(p.relative_to(REPO)) for p in (REPO / "coc_inject").rglob("*.py") if "_site" not in p.parts)
    copied = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "coc_inject").rglob("*"))
    assert [p for p in copied if p.endswith(".py")] == ours
    assert not any("__pycache__" in p or p.endswith(".pyc") for p in copied)


def test_bench_check_variants_catches_a_variant_with_byte_code(tmp_path):
    envs = startup.variant_envs(tmp_path / "nopyc")
    assert set(envs) == set(startup.VARIANTS)
    envs = {name: dict(env, COC_CACHE_DIR=str(tmp_path / name)) for name, env in envs.items()}
    startup.check_variants(sys.executable, envs)  # as built: fine
    wrong = dict(envs, nopyc_on=dict(envs["nopyc_on"], PYTHONPATH=envs["on"]["PYTHONPATH"]))
    with pytest.raises(SystemExit, match="nopyc_on"):  # the checkout, not the copy
        startup.check_variants(sys.executable, wrong)
    wrong = dict(envs, nopyc_off=dict(envs["nopyc_off"]))
    del wrong["nopyc_off"]["PYTHONDONTWRITEBYTECODE"]  # would write __pycache__ next to the copy
    with pytest.raises(SystemExit, match="nopyc_off"):
        startup.check_variants(sys.executable, wrong)


def test_bench_report(tmp_path, capsys):
    out = tmp_path / "startup.json"
    rc = startup.main(["--reps", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    assert rc == (0 if result["pass"] else 1)
    for key in ("python", "reps", "median_ms", "p10_ms", "p90_ms", "median_delta_vs_bare_ms", "cpu_median_ms",
                "cpu_median_delta_vs_bare_ms", "target_ms", "pass", "samples_wall_ms", "samples_cpu_ms"):
        assert key in result  # the keys the report always had
    assert set(result["median_ms"]) == set(startup.VARIANTS)
    assert result["target_variants"] == ["off", "on", "nopyc_off", "nopyc_on"]
    assert result["pass"] == all(result["median_delta_vs_bare_ms"][k] <= 3.0 for k in result["target_variants"])
    assert result["nopyc_cache_files"] == 2  # __init__ and bootstrap, reused by the warm starts
    text = capsys.readouterr().out
    assert "nopyc_on_cold" in text and "first start with an empty cache" in text
