"""Every patch can be undone, and undoing never takes another patcher's away (coc_inject.patches)."""

import logging
import types

from coc_inject import job, log
from coc_inject.config import CocConfig
from coc_inject.patches import Patches


def _owners():
    class Layer:
        def forward(self):
            return "megatron"

    module = types.ModuleType("megatron_stand_in")  # a module, as Megatron's parallel_state
    module.initialize = lambda: "megatron"
    return Layer, module


def test_restore_puts_every_original_back_where_the_patch_is_still_ours():
    Layer, module = _owners()
    original_forward, original_initialize = Layer.__dict__["forward"], module.initialize
    patches = Patches()
    patches.patch(Layer, "forward", lambda self: "coc")
    patches.patch(Layer, "forward", lambda self: "coc again")  # a second patch still undoes to Megatron's
    patches.patch(module, "initialize", lambda: "coc")
    assert Layer().forward() == "coc again" and module.initialize() == "coc"
    assert patches.restore() == []
    assert Layer.__dict__["forward"] is original_forward and module.initialize is original_initialize
    assert not patches


def test_restore_leaves_a_later_patchers_replacement_and_names_it():
    """MindSpeed's adaptor sets its own over Megatron's after coc-inject's hook patched it; putting the
    original back would silently take MindSpeed's patch away."""
    Layer, module = _owners()
    original_initialize = module.initialize
    patches = Patches()
    patches.patch(Layer, "forward", lambda self: "coc")
    patches.patch(module, "initialize", lambda: "coc")
    ours = module.initialize

    def theirs():  # wraps what it found: coc-inject's
        return "theirs over " + ours()

    module.initialize = theirs
    left = patches.restore()
    assert [(owner, name) for owner, name, _, _ in left] == [(module, "initialize")] and left[0][2] is theirs
    assert left[0][3] is False  # it calls coc-inject's, but without functools.wraps nothing says so
    assert module.initialize is theirs and module.initialize() == "theirs over coc"
    assert Layer().forward() == "megatron"  # the one still ours was put back
    assert module.initialize is not original_initialize


def test_uninstall_warns_about_what_it_left(caplog):
    job.uninstall()
    Layer, module = _owners()
    installation = job.installation(CocConfig(parallel_num=2))
    installation.patches.patch(module, "initialize", lambda: "coc")

    def mindspeed_wrapper():
        return "theirs"

    module.initialize = mindspeed_wrapper
    with caplog.at_level(logging.WARNING, logger=log.logger.name):
        job.uninstall()
    (line,) = [r.getMessage() for r in caplog.records if "uninstall:" in r.getMessage()]
    assert "initialize (now: " in line and "mindspeed_wrapper" in line and "left in place" in line
    assert module.initialize is mindspeed_wrapper
