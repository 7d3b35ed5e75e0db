"""install()/uninstall() on the real megatron-core layer classes, in this process."""

import logging
import pathlib
import types

import pytest

layers = pytest.importorskip("megatron.core.tensor_parallel.layers")

from coc_inject import log, patching  # noqa: E402
from coc_inject.config import CocConfig  # noqa: E402

CLASSES = (layers.ColumnParallelLinear, layers.RowParallelLinear)
ORIGINALS = {cls: cls.__dict__["forward"] for cls in CLASSES}


@pytest.fixture(autouse=True)
def restore():
    yield
    patching.uninstall()
    for cls, original in ORIGINALS.items():
        cls.forward = original


def test_install_wraps_both_layers_with_plain_functions():
    assert patching.install(CocConfig(parallel_num=4), layers)
    for cls in CLASSES:
        forward = cls.__dict__["forward"]
        assert forward is not ORIGINALS[cls]
        # A plain function (dynamo traces it), not a wrapt proxy (dynamo would skip to the original).
        assert type(forward) is types.FunctionType
        assert forward.__wrapped__ is ORIGINALS[cls] and forward.__coc_inject__
    assert patching.is_installed() and patching.engine().config.parallel_num == 4


def test_install_twice_never_double_wraps():
    patching.install(CocConfig(parallel_num=2), layers)
    patching.install(CocConfig(parallel_num=8), layers)
    for cls in CLASSES:
        assert cls.__dict__["forward"].__wrapped__ is ORIGINALS[cls]
    assert patching.engine().config.parallel_num == 8


def test_uninstall_restores_originals_and_is_idempotent():
    patching.install(CocConfig(parallel_num=4), layers)
    patching.uninstall()
    patching.uninstall()
    for cls in CLASSES:
        assert cls.__dict__["forward"] is ORIGINALS[cls]
    assert not patching.is_installed() and patching.engine() is None


@pytest.mark.parametrize("config", [CocConfig(), CocConfig(parallel_num=4, disabled=True)])
def test_off_config_patches_nothing(config):
    assert patching.install(config, layers) is False
    for cls in CLASSES:
        assert cls.__dict__["forward"] is ORIGINALS[cls]


def test_unsupported_megatron_version_is_left_alone_and_said(monkeypatch):
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    monkeypatch.setattr(patching, "megatron_version", lambda: "0.9.0")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.logger.addHandler(handler)
    try:
        patching.on_layers_imported(layers)
    finally:
        log.logger.removeHandler(handler)
    assert not patching.is_installed()
    assert any("CoC NOT applied: megatron-core 0.9.0" in r.getMessage() for r in records)


@pytest.mark.parametrize("version,supported", [("0.13.1", True), ("0.16.1", True), ("0.12.3", False),
                                               ("0.17.0", False), ("", False), ("dev", False)])
def test_version_gate(version, supported):
    assert patching.megatron_supported(version) is supported


def test_engine_never_allocates_with_cuda_current_device():
    # BRIEF §2: Megatron's torch.cuda.current_device() allocations break on CPU/NPU; ours follow
    # the input's device.
    # (coc_inject/bench is left out: its CPU ranks point Megatron's own calls at the CPU.)
    package = pathlib.Path(patching.__file__).parent
    for source in package.rglob("*.py"):
        if "bench" not in source.parts:
            assert "current_device" not in source.read_text(), source


def test_readme_reference_tables_are_current():
    from coc_inject.cli import reference_markdown

    readme = (pathlib.Path(patching.__file__).parent.parent / "README.md").read_text()
    assert reference_markdown() in readme, "README tables are stale: paste `coc-inject reference`"
