"""install()/uninstall() on the real megatron-core layer classes, in this process."""

import logging
import pathlib
import types

import pytest

layers = pytest.importorskip("megatron.core.tensor_parallel.layers")

import coc_inject  # noqa: E402
from coc_inject import log, megatron_version  # noqa: E402
from coc_inject.linears import install as linears  # noqa: E402
from coc_inject.config import CocConfig  # noqa: E402

CLASSES = (layers.ColumnParallelLinear, layers.RowParallelLinear)
ORIGINALS = {cls: cls.__dict__["forward"] for cls in CLASSES}


@pytest.fixture(autouse=True)
def restore():
    yield
    linears.uninstall()
    for cls, original in ORIGINALS.items():
        cls.forward = original


def test_install_wraps_both_layers_with_plain_functions():
    assert linears.install(CocConfig(parallel_num=4), layers)
    for cls in CLASSES:
        forward = cls.__dict__["forward"]
        assert forward is not ORIGINALS[cls]
        # A plain function (dynamo traces it), not a wrapt proxy (dynamo would skip to the original).
        assert type(forward) is types.FunctionType
        assert forward.__wrapped__ is ORIGINALS[cls] and forward.__coc_inject__
    assert linears.is_installed() and linears.engine().config.parallel_num == 4


def test_install_twice_never_double_wraps():
    linears.install(CocConfig(parallel_num=2), layers)
    linears.install(CocConfig(parallel_num=8), layers)
    for cls in CLASSES:
        assert cls.__dict__["forward"].__wrapped__ is ORIGINALS[cls]
    assert linears.engine().config.parallel_num == 8


def test_uninstall_restores_originals_and_is_idempotent():
    linears.install(CocConfig(parallel_num=4), layers)
    linears.uninstall()
    linears.uninstall()
    for cls in CLASSES:
        assert cls.__dict__["forward"] is ORIGINALS[cls]
    assert not linears.is_installed() and linears.engine() is None


@pytest.mark.parametrize("config", [CocConfig(), CocConfig(parallel_num=4, disabled=True)])
def test_off_config_patches_nothing(config):
    assert linears.install(config, layers) is False
    for cls in CLASSES:
        assert cls.__dict__["forward"] is ORIGINALS[cls]


def _on_layers_imported_saying(monkeypatch, version, **env):
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    megatron = megatron_version.Megatron(version, "/checkout/megatron/core")
    monkeypatch.setattr(megatron_version, "imported", lambda: megatron)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log.logger.addHandler(handler)
    try:
        linears.on_layers_imported(layers)
    finally:
        log.logger.removeHandler(handler)
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("version", ["0.9.0", "0.20.0"])
def test_untested_megatron_version_is_left_alone_and_said(monkeypatch, version):
    warnings = _on_layers_imported_saying(monkeypatch, version)
    assert not linears.is_installed()
    assert len(warnings) == 1
    assert (f"CoC NOT applied: megatron-core {version} from directory /checkout is outside the tested range "
            "0.12 .. 0.19.x") in warnings[0]
    assert "COC_ALLOW_UNTESTED_MEGATRON=1" in warnings[0]


def test_untested_megatron_version_is_patched_when_opted_in_and_said(monkeypatch):
    try:
        warnings = _on_layers_imported_saying(monkeypatch, "0.20.0", COC_ALLOW_UNTESTED_MEGATRON="1")
        assert linears.is_installed()
    finally:
        linears.uninstall()
    assert len(warnings) == 1 and "0.20.0 from directory /checkout is outside the tested range" in warnings[0]
    assert "UNTESTED" in warnings[0]


@pytest.mark.parametrize("version,why", [
    (None, "megatron.core.package_info.__version__ is missing, and no installed megatron-core distribution owns "
           "/checkout/megatron/core"),
    ("dev", "megatron.core.package_info.__version__ is 'dev', not a release number"),
])
def test_unknown_megatron_version_is_left_alone_and_said(monkeypatch, version, why):
    warnings = _on_layers_imported_saying(monkeypatch, version)
    assert not linears.is_installed()
    assert warnings == [f"CoC NOT applied: the release of megatron.core from directory /checkout cannot be "
                        f"determined ({why}); set COC_ALLOW_UNTESTED_MEGATRON=1 to try it anyway"]


def test_unknown_megatron_version_is_patched_when_opted_in_and_said(monkeypatch):
    try:
        warnings = _on_layers_imported_saying(monkeypatch, None, COC_ALLOW_UNTESTED_MEGATRON="1")
        assert linears.is_installed()
    finally:
        linears.uninstall()
    assert len(warnings) == 1 and "cannot be determined" in warnings[0] and "UNTESTED" in warnings[0]


def test_tested_megatron_version_is_patched_without_warning(monkeypatch):
    try:
        warnings = _on_layers_imported_saying(monkeypatch, "0.19.2")
        assert linears.is_installed()
    finally:
        linears.uninstall()
    assert warnings == []


def test_uninstall_restores_every_attribute_both_wings_patched(monkeypatch):
    # The bootstrap's three hooks on the real classes: one installation, shared by both wings.
    from megatron.core import parallel_state
    from megatron.core.transformer import dot_product_attention

    from coc_inject import job
    from coc_inject.context_parallel import install as attention_install

    attention = dot_product_attention.DotProductAttention
    watched = [(cls, "forward") for cls in CLASSES] + [
        (attention, "__init__"), (attention, "forward"),
        (parallel_state, "initialize_model_parallel"), (parallel_state, "destroy_model_parallel")]
    before = [vars(owner)[name] for owner, name in watched]
    monkeypatch.setenv("COC_PARALLEL_NUM", "4")
    monkeypatch.setenv("COC_CP_ALGO", "ring")
    try:
        attention_install.on_parallel_state_imported(parallel_state)
        linears.on_layers_imported(layers)
        attention_install.on_attention_imported(dot_product_attention)
        installation = job.current()
        assert sorted(map(repr, installation.patches.patched())) == sorted(map(repr, watched))
        assert all(vars(owner)[name] is not original for (owner, name), original in zip(watched, before))
        assert linears.engine().coverage is installation.coverage is not None
    finally:
        linears.uninstall()
    assert [vars(owner)[name] for owner, name in watched] == before
    assert job.current() is None and not linears.is_installed()


@pytest.mark.parametrize("version,allow,support", [
    ("0.12.1", False, "tested"), ("0.13.1", False, "tested"), ("0.16.1", False, "tested"), ("0.17.1", False, "tested"),
    ("0.18.2", False, "tested"), ("0.19.2", False, "tested"), ("0.19.3rc0", False, "tested"),
    ("0.11.0", False, "unsupported"), ("0.20.0", False, "unsupported"), ("0.20.0", True, "untested"),
    ("0.11.0", True, "untested"), ("0.19.2+1a2b3c4", False, "tested"), ("0.20.0rc0", False, "unsupported"),
    ("", False, "unknown"), ("dev", False, "unknown"), (None, False, "unknown"), ("1", False, "unknown"),
    ("", True, "untested"), ("dev", True, "untested"), (None, True, "untested"),
])
def test_version_gate(version, allow, support):
    assert megatron_version.support(version, allow) == support


def test_status_lists_the_guards_of_the_installed_release():
    from coc_inject.cli import megatron_report
    from coc_inject.linears.guards import GUARDS

    def found(version):
        return megatron_version.Megatron(version, "/checkout/megatron/core")

    report = megatron_report(found("0.18.2"), False)
    assert "0.18.2 tested" in report and "from            : directory /checkout" in report
    marks = {line.split("] ", 1)[1].split(" (since")[0]: line[3] for line in report.splitlines() if "[" in line[:4]}
    assert marks == {guard.feature: "x" if guard.since <= (0, 18) else " " for guard in GUARDS}
    assert "unsupported, layers left unpatched" in megatron_report(found("0.21.0"), False)
    assert "UNTESTED, patched anyway" in megatron_report(found("0.21.0"), True)
    assert "release unknown, layers left unpatched" in megatron_report(found(None), False)
    assert "not found" in megatron_report(None, False)


def test_engine_never_allocates_with_cuda_current_device():
    # Megatron's torch.cuda.current_device() allocations break on CPU/NPU; ours follow
    # the input's device.
    # (coc_inject/testbed and coc_inject/lab are left out: their CPU ranks point Megatron's own calls at the CPU.)
    package = pathlib.Path(coc_inject.__file__).parent
    for source in package.rglob("*.py"):
        if not {"testbed", "lab"} & set(source.parts):
            assert "current_device" not in source.read_text(), source
