"""What a non-editable install ships: every package of the checkout (a subpackage left out of
pyproject.toml works from the checkout and fails for every user who pip-installed coc-inject)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_subpackage_is_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "coc_inject").rglob("__init__.py")}
    assert found - listed == set()
    assert listed - found == {"coc_inject._site"}  # sitecustomize/, shipped under that name (package-dir)


def test_the_npu_extra_pins_torch_npu_to_one_torch_release():
    """#54: the npu extra named torch-npu unpinned, whose releases each pair with one torch release."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["npu"] == ["torch-npu==2.7.1.*"]
