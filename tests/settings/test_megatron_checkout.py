"""megatron.core from a directory on PYTHONPATH (a Megatron-LM checkout), no megatron-core
distribution installed (issue 13): the version gate, the banner, the report and ``status`` read
the imported module's own version.

The environment: a venv made with ``--without-pip`` whose site-packages holds a symlink to every
entry of this venv's site-packages except megatron-core (``megatron/``, its dist-info) and
coc-inject (the bootstrap on PYTHONPATH brings the checkout's). The "checkout" is a copy of the
installed ``megatron/core``; a second copy's ``package_info`` says 0.99.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import RANKS, SITE, clean_env  # noqa: E402

SPEC = importlib.util.find_spec("megatron.core")
if SPEC is None:
    pytest.skip("megatron-core is not installed", allow_module_level=True)
INSTALLED_CORE = Path(list(SPEC.submodule_search_locations)[0])
LEFT_OUT = re.compile(r"(megatron|megatron_core-.*\.dist-info|coc_inject|coc_inject-.*\.dist-info)$")
MODEL = ["--steps", "3", "--num-layers", "1", "--hidden-size", "64", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--micro-batch-size", "2", "--vocab-size", "256", "--num-attention-heads", "4"]
# A warning attributed to coc-inject's own code, as Python prints it: "<path>/coc_inject/x.py:12: FutureWarning: ..."
OUR_WARNING = re.compile(r"coc_inject[\\/]\S*\.py:\d+: \w*Warning")
IMPORT_LAYERS = ("import megatron.core.tensor_parallel.layers as layers\n"
                 "print('patched:', getattr(layers.RowParallelLinear.forward, '__coc_inject__', False))")


def version_in(core_dir: Path) -> str:
    """The version package_info.py spells out (MAJOR.MINOR.PATCH + PRE_RELEASE), read as text."""
    text = (core_dir / "package_info.py").read_text()
    parts = {name: re.search(rf"^{name} = (.*)$", text, re.M).group(1).strip().strip("'\"")
             for name in ("MAJOR", "MINOR", "PATCH", "PRE_RELEASE")}
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts['PRE_RELEASE']}"


def checkout(tmp: Path, name: str, minor: int | None = None) -> Path:
    """A directory holding megatron/core (no distribution metadata), optionally re-versioned 0.<minor>.0."""
    core_dir = tmp / name / "megatron" / "core"
    shutil.copytree(INSTALLED_CORE, core_dir, symlinks=True)
    if minor is not None:
        info = core_dir / "package_info.py"
        text = re.sub(r"^MINOR = \d+$", f"MINOR = {minor}", info.read_text(), flags=re.M)
        info.write_text(re.sub(r"^PATCH = \d+$", "PATCH = 0", text, flags=re.M))
    return tmp / name


def venv_without_megatron(tmp: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; "
                                  "print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.strip())
    for entry in ours.iterdir():
        if not LEFT_OUT.match(entry.name):
            (theirs / entry.name).symlink_to(entry)
    return venv / "bin" / "python"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("checkout")
    python = venv_without_megatron(tmp)
    return {"python": str(python), "tmp": tmp, "checkout": checkout(tmp, "megatron-lm"),
            "checkout99": checkout(tmp, "megatron-lm-099", minor=99)}


def run(env, args, pythonpath, workdir, **variables):
    return subprocess.run([env["python"], *args], env=clean_env(PYTHONPATH=pythonpath, **variables), cwd=workdir,
                          capture_output=True, text=True, timeout=300)


def tiny_gpt(env, name, pythonpath, **variables):
    workdir = env["tmp"] / name
    workdir.mkdir()
    proc = run(env, ["-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--standalone",
                     str(ROOT / "examples" / "pretrain_tiny_gpt.py"), *MODEL, "--json", str(workdir / "run.json")],
               pythonpath, workdir, **variables)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc, json.loads((workdir / "run.json").read_text()), workdir


@pytest.fixture(scope="module")
def gpt_runs(env):
    checkout_dir = str(env["checkout"])
    off = tiny_gpt(env, "off", checkout_dir)
    on = tiny_gpt(env, "on", f"{SITE}{os.pathsep}{checkout_dir}", COC_PARALLEL_NUM="4",
                  COC_REPORT=str(env["tmp"] / "on" / "coc-{rank}.json"))
    return off, on


def test_the_environment_has_no_megatron_distribution(env):
    probe = ("import importlib.metadata as m, importlib.util as u\n"
             "try:\n    m.version('megatron-core'); print('distribution')\nexcept m.PackageNotFoundError:\n"
             "    print('none')\nprint(u.find_spec('megatron.core') is not None)")
    proc = run(env, ["-c", probe], str(env["checkout"]), env["tmp"])
    assert proc.stdout.split() == ["none", "True"], proc.stderr


def test_gpt_from_a_checkout_is_patched_and_matches_off(gpt_runs, env):
    (_, off, _), (proc, on, workdir) = gpt_runs
    version = version_in(env["checkout"] / "megatron" / "core")
    banners = [line for line in proc.stderr.splitlines() if "CoC installed" in line]
    assert len(banners) == 1 and f"megatron-core {version}," in banners[0], proc.stderr[-3000:]
    assert "CoC NOT applied" not in proc.stderr
    assert "first step: CoC on 5 of 5 TP linear layers; layer calls: 5 chunked (N=4)" in proc.stderr
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-5, abs=0)
    for rank in range(RANKS):
        assert json.loads((workdir / f"coc-{rank}.json").read_text())["megatron_core"] == version


def test_no_warning_comes_from_coc_inject_code(gpt_runs):
    # Before issue 13 every run printed coc_inject/coverage.py:139: FutureWarning (torch.distributed.reduce_op),
    # from the scan over live objects at the first-step summary.
    _, (proc, _, _) = gpt_runs
    assert "first step:" in proc.stderr
    assert not OUR_WARNING.search(proc.stderr), OUR_WARNING.search(proc.stderr).group(0)


@pytest.fixture(scope="module")
def imports_of_099(env):
    """Import the layers from the 0.99 checkout with CoC on, without and with the opt-in (at once)."""
    pythonpath = f"{SITE}{os.pathsep}{env['checkout99']}"
    procs = {allow: subprocess.Popen([env["python"], "-c", IMPORT_LAYERS], cwd=env["tmp"], text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=clean_env(PYTHONPATH=pythonpath, COC_PARALLEL_NUM="4",
                                                   COC_ALLOW_UNTESTED_MEGATRON=allow))
             for allow in ("0", "1")}
    results = {}
    for allow, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        results[allow == "1"] = (stdout, [line for line in stderr.splitlines() if line.startswith("[coc-inject")])
    return results


def test_newer_checkout_is_left_unpatched_naming_its_version(imports_of_099, env):
    stdout, said = imports_of_099[False]
    assert "patched: False" in stdout
    assert said == [f"[coc-inject] CoC NOT applied: megatron-core 0.99.0 from directory {env['checkout99']} is "
                    "outside the tested range 0.12 .. 0.19.x; set COC_ALLOW_UNTESTED_MEGATRON=1 to try it anyway"]


def test_newer_checkout_is_patched_when_opted_in(imports_of_099):
    stdout, said = imports_of_099[True]
    assert "patched: True" in stdout
    assert len(said) == 2, said
    assert "megatron-core 0.99.0 from directory" in said[0] and "CoC is applied UNTESTED" in said[0]
    assert said[1].startswith("[coc-inject] CoC installed") and "megatron-core 0.99.0," in said[1]


def test_status_names_the_checkout_import_would_find(env):
    checkout99 = env["checkout99"]
    proc = run(env, ["-m", "coc_inject", "status"], f"{ROOT}{os.pathsep}{checkout99}", env["tmp"])
    assert "megatron-core     : 0.99.0 unsupported, layers left unpatched" in proc.stdout, proc.stdout + proc.stderr
    assert f"  from            : directory {checkout99}\n" in proc.stdout
    # In this venv, where megatron-core is installed, the same directory shadows that distribution.
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "status"], cwd=env["tmp"], capture_output=True,
                          text=True, timeout=120, env=clean_env(PYTHONPATH=f"{ROOT}{os.pathsep}{checkout99}"))
    assert f"  from            : directory {checkout99}, shadowing the installed megatron-core" in proc.stdout, \
        proc.stdout + proc.stderr
    assert "megatron-core     : 0.99.0 unsupported" in proc.stdout
