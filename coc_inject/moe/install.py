"""install() of the MoE wing, and its post-import hook (registered by bootstrap) on
``megatron.core.transformer.moe.moe_layer``; patches through the job's installation.

Megatron's ``MoELayer.forward`` runs unchanged (routing, permutation, shared expert, recompute,
aux losses); its wrapper decides each call (calls.py) and, for a call that runs as pieces, the
dispatcher's two all-to-alls and the experts' loop move into one call in the experts' place
(stages.py says which of Megatron's methods are wrapped for that, per release).
"""

from __future__ import annotations

from coc_inject import job, mindspeed
from coc_inject.moe import calls, guards, permutation_stages, stages


def install(config, moe_layer_module, chunks: int | None = None) -> None:
    """Patch for ``config.moe_overlap``, counting no calls (tests, bench; the import hook counts):
    into the job's installation for ``config``. Undone by ``job.uninstall()``. ``chunks``: a fixed
    count per local expert instead of COC_MOE_OVERLAP=1's (the bench's variants)."""
    _install(job.installation(config), moe_layer_module, chunks)


def banner(config) -> str:
    if _left_to_mindspeed:
        return "MoE overlap not installed" + mindspeed.note(mindspeed.MOE)
    pieces = "pieces or Megatron's per layer shape (auto)" if config.moe_overlap == "auto" else "pieces"
    return (f"MoE overlap installed on MoELayer: alltoall dispatch and combine in {pieces} (details: coc-inject "
            f"status){mindspeed.note(mindspeed.MOE)}")


_left_to_mindspeed: list = []  # what MindSpeed had replaced at the last install (the whole wing stepped aside)


def _install(installation, moe_layer_module, chunks: int | None = None) -> None:
    from megatron.core.transformer.moe import experts, token_dispatcher

    patches = installation.patches
    dispatcher, layer = token_dispatcher.MoEAlltoAllTokenDispatcher, moe_layer_module.MoELayer
    _left_to_mindspeed[:] = [(what, feature) for what, feature in (
        ("MoELayer", mindspeed.attribute_feature(moe_layer_module, "MoELayer", mindspeed.MOE)),
        *((f"MoEAlltoAllTokenDispatcher.{name}", mindspeed.attribute_feature(dispatcher, name, mindspeed.MOE))
          for name in guards.MINDSPEED_DISPATCH),
    ) if feature is not None]
    for what, feature in _left_to_mindspeed:  # MindSpeed's layer or dispatch in Megatron's place: nothing patched
        mindspeed.aside(mindspeed.MOE, what, feature)
    if _left_to_mindspeed:
        return
    stages.install_preprocess(patches, dispatcher)
    taken = None  # the experts classes whose forward runs the pieces (None: any, the layer's stages run them)
    classes = _experts_classes(experts)
    if stages.has_layer_stages(layer):
        megatron_middle = stages.install_layer_stages(patches, layer)
    elif stages.has_dispatcher_stages(dispatcher, classes):
        taken = classes
        megatron_middle = stages.install_dispatcher_stages(patches, dispatcher, taken)
    elif permutation_stages.has_permutation_stages(dispatcher):  # 0.12: token_permutation / token_unpermutation
        taken = classes
        megatron_middle = permutation_stages.install(patches, dispatcher, taken)
    else:  # no stage to take over: every layer runs Megatron's dispatcher (guards.layer_reason says why)
        megatron_middle = None
    original_forward = patches.original(layer, "forward")
    patches.patch(layer, "forward", calls.layer_forward(installation, original_forward, chunks, megatron_middle, taken))


def _experts_classes(experts_module) -> list:
    """The experts classes whose forward runs the pieces on 0.12 to 0.15: SequentialMLP, and the legacy
    GroupedMLP and TEGroupedMLP where MindSpeed did not put its own grouped experts there (guards
    send a layer with MindSpeed's class to Megatron's path, naming MindSpeed's feature)."""
    classes = [experts_module.SequentialMLP]
    for name in ("GroupedMLP", "TEGroupedMLP"):
        if hasattr(experts_module, name) and mindspeed.attribute_feature(experts_module, name, mindspeed.MOE) is None:
            classes.append(getattr(experts_module, name))
    return classes


on_moe_layer_imported = job.wing_hook(lambda config: config.moe_armed, _install, banner)
