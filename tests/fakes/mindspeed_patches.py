"""Stand-ins for MindSpeed's patches (core_r0.12.1's adaptor), applied the way MindSpeed applies them.

MindSpeed itself imports torch_npu, so it never runs here. Each stand-in is defined in a namespace
named as MindSpeed's module (a class's ``__module__``, a function's globals' ``__name__``), and
``apply`` does what ``mindspeed.patch_utils.Patch.apply_patch`` does: ``setattr`` on the owner (a
module or a class), and on every module of ``sys.modules`` that holds the same object. A replaced
class is a subclass of Megatron's with MindSpeed's Impl first (its forward calling Megatron's, as
MindSpeed's CoC does where it leaves a call to Megatron); a ``*_wrapper`` wraps what is there.
"""

from __future__ import annotations

import functools
import importlib
import sys


def _namespace(module_name: str) -> dict:
    return {"__name__": module_name, "functools": functools}


def subclass(module_name: str, name: str, base: type) -> type:
    """MindSpeed's class ``module_name.name`` in Megatron's ``base``'s place."""
    namespace = _namespace(module_name)
    namespace["base"] = base
    exec(f"class {name}(base):\n"
         "    def forward(self, *args, **kwargs):\n"
         "        return super().forward(*args, **kwargs)\n", namespace)
    return namespace[name]


def wrapper(module_name: str, name: str):
    """MindSpeed's decorator ``module_name.name`` (functools.wraps: ``__module__`` stays Megatron's)."""
    namespace = _namespace(module_name)
    exec(f"def {name}(fn):\n"
         "    @functools.wraps(fn)\n"
         "    def wrapper(*args, **kwargs):\n"
         "        return fn(*args, **kwargs)\n"
         "    return wrapper\n", namespace)
    return namespace[name]


def function(module_name: str, name: str):
    """MindSpeed's function ``module_name.name`` put in Megatron's place: its own code, calling nothing it replaced."""
    namespace = _namespace(module_name)
    exec(f"def {name}(*args, **kwargs):\n"
         "    raise AssertionError('the stand-in of MindSpeed\\'s own implementation is not run here')\n", namespace)
    return namespace[name]


def _owner(path: str):
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ImportError(path)


class Applied:
    """The patches applied, undone by ``undo()`` (last first)."""

    def __init__(self):
        self._undo: list = []

    def apply(self, path: str, make) -> object:
        """Replace Megatron's ``path`` by ``make(original)``, as MindSpeed's patch manager does."""
        owner, name = _owner(path)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        replacement = make(original)
        holders = [owner] + [module for module in list(sys.modules.values())
                             if module is not owner and getattr(module, name, None) is original]
        for holder in holders:
            setattr(holder, name, replacement)
            self._undo.append((holder, name, original))
        return replacement

    def undo(self) -> None:
        while self._undo:
            holder, name, original = self._undo.pop()
            setattr(holder, name, original)


_TP, _CP = "mindspeed.core.tensor_parallel", "mindspeed.core.context_parallel"
_MOE = "mindspeed.core.transformer.moe.moe_feature.adaptor"
LAYERS = "megatron.core.tensor_parallel.layers"


def ascend_coc(applied: Applied) -> None:
    """--use-ascend-coc: ColumnParallelLinear / RowParallelLinear replaced by MindSpeed's CoC classes."""
    applied.apply(f"{LAYERS}.ColumnParallelLinear",
                  lambda base: subclass(f"{_TP}.coc_feature.adaptor", "MindSpeedCoCColumnParallelLinear", base))
    applied.apply(f"{LAYERS}.RowParallelLinear",
                  lambda base: subclass(f"{_TP}.coc_feature.adaptor", "MindSpeedCoCRowParallelLinear", base))


def ascend_mc2(applied: Applied) -> None:
    """--use-ascend-mc2 (TP > 1 with sequence parallelism): MindSpeed's MC2 classes."""
    applied.apply(f"{LAYERS}.ColumnParallelLinear",
                  lambda base: subclass(f"{_TP}.mc2_feature.adaptor", "MindSpeedMC2ColumnParallelLinear", base))
    applied.apply(f"{LAYERS}.RowParallelLinear",
                  lambda base: subclass(f"{_TP}.mc2_feature.adaptor", "MindSpeedMC2RowParallelLinear", base))


def context_parallel(applied: Applied) -> None:
    """--context-parallel-size > 1 (any --context-parallel-algo): MindSpeed's CP attention and groups."""
    applied.apply("megatron.core.transformer.dot_product_attention.DotProductAttention",
                  lambda base: subclass(f"{_CP}.adaptor", "MindSpeedCPDotProductAttention", base))
    applied.apply("megatron.core.transformer.attention.Attention.__init__",
                  wrapper(f"{_CP}.adaptor", "attention_init_wrapper"))
    applied.apply("megatron.core.parallel_state.initialize_model_parallel",
                  wrapper(f"{_CP}.model_parallel_utils", "initialize_model_parallel_cp_wrapper"))


def moe_alltoall_overlap_comm(applied: Applied) -> None:
    """--moe-alltoall-overlap-comm with the alltoall dispatcher: MindSpeed's MoE layer."""
    applied.apply("megatron.core.transformer.moe.moe_layer.MoELayer",
                  lambda base: subclass(_MOE, "MindSpeedAlltoAllOverlapMoeLayerAdaptor", base))


def grouped_gemm(applied: Applied) -> None:
    """--moe-grouped-gemm: MindSpeed's grouped matmul experts in GroupedMLP's place."""
    applied.apply("megatron.core.transformer.moe.experts.GroupedMLP",
                  lambda base: subclass(_MOE, "MindSpeedGmmExperts", base))


def moe_permute_fusion(applied: Applied) -> None:
    """--moe-permute-fusion with the alltoall dispatcher: preprocess wrapped by MindSpeed's sync wrapper (2.3.0+),
    _maybe_dtoh_and_synchronize replaced (2.2.0+)."""
    dispatcher = "megatron.core.transformer.moe.token_dispatcher.MoEAlltoAllTokenDispatcher"
    applied.apply(f"{dispatcher}.preprocess", wrapper("mindspeed.core.fusions.fused_moe_permute", "preprocess_sync_wrapper"))
    applied.apply(f"{dispatcher}._maybe_dtoh_and_synchronize",
                  lambda original: function("mindspeed.core.fusions.fused_moe_permute", "maybe_dtoh_and_synchronize"))


BLOCK = "megatron.core.transformer.transformer_block.TransformerBlock"


def _te_checkpoint_module() -> dict:
    """tests/fakes/mindspeed_te_checkpoint.py's source run in a namespace named as MindSpeed's module."""
    import pathlib

    path = pathlib.Path(__file__).with_name("mindspeed_te_checkpoint.py")
    namespace = {"__name__": "mindspeed.te.pytorch.module.checkpoint"}
    exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), namespace)
    return namespace


def te_basic_block_forward(applied: Applied, recompute_method: str | None = None) -> None:
    """MindSpeed 26.0+, every job (TransformerEngineBasicFeature.register_patches): TransformerBlock.forward
    replaced by its own (megatron-core 0.12's, restated in mindspeed_te_checkpoint.py), and the block's
    _checkpointed_forward too unless --recompute-method block (or --swap-attention)."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    module = _te_checkpoint_module()
    applied.apply(f"{BLOCK}.forward", lambda original: module["transformer_block_forward"])
    # megatron-core 0.19 moved the block's recompute out of the class: MindSpeed's manager would stop there
    if recompute_method != "block" and "_checkpointed_forward" in TransformerBlock.__dict__:
        applied.apply(f"{BLOCK}._checkpointed_forward",
                      lambda original: module["transformer_block_checkpointed_forward"])


def unread_block_forward(applied: Applied) -> None:
    """A block forward of MindSpeed's that coc-inject has not read (the same name in another module)."""
    module = "mindspeed.core.transformer.transformer_block"
    applied.apply(f"{BLOCK}.forward", lambda original: function(module, "transformer_block_forward"))


def tp_2d_block_forward(applied: Applied) -> None:
    """--tp-2d: TransformerBlock.forward wrapped (functools.wraps: what it wraps still runs inside)."""
    applied.apply(f"{BLOCK}.forward", wrapper(f"{_TP}.tp_2d.adaptor", "mindspeed_transformer_block_forward_wrapper"))


def ripipe_checkpoint(applied: Applied) -> None:
    """--recompute-in-advance (ripipe): tensor_parallel.random.checkpoint wrapped."""
    applied.apply("megatron.core.tensor_parallel.random.checkpoint",
                  wrapper(f"{_TP}.random", "checkpoint_wrapper"))


TE_CHECKPOINT, MEMORY_COMMON = "mindspeed.te.pytorch.module.checkpoint", "mindspeed.core.memory.common"


def _restated(original, module_name: str, name: str):
    """``original`` (Megatron's block recompute) restated as MindSpeed's function ``module_name.name``: the same
    source, run in a copy of its globals named as MindSpeed's module (its chunk closure's module and qualname
    are MindSpeed's), so that it runs Megatron's chunks exactly on every megatron-core."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(original))
    source = source.replace(f"def {original.__name__}(", f"def {name}(", 1)
    namespace = dict(original.__globals__, __name__=module_name)
    exec(compile(source, f"<{module_name}>", "exec"), namespace)
    return namespace[name]


def block_recompute(applied: Applied, module_name: str = MEMORY_COMMON) -> None:
    """The block's full recompute replaced by MindSpeed's ``module_name.transformer_block_checkpointed_forward``:
    ``mindspeed.core.memory.common``'s under ``--recompute-method block``
    (mindspeed/features_manager/recompute/recompute_method.py registers it on
    TransformerBlock._checkpointed_forward; multi-copy has not read it), or ``mindspeed.te.pytorch.module.checkpoint``'s
    (TransformerEngineBasicFeature; read: recompute.BLOCK_CHUNKS). Either restated from Megatron's own
    (:func:`_restated`) so that the MoE GPT of every megatron-core runs it; on 0.19, which moved the block's
    recompute to megatron.core.recompute.checkpointed_forward, that function is the one replaced."""
    from megatron.core.transformer.transformer_block import TransformerBlock

    path = (f"{BLOCK}._checkpointed_forward" if "_checkpointed_forward" in vars(TransformerBlock)
            else "megatron.core.recompute.checkpointed_forward")
    applied.apply(path, lambda original: _restated(original, module_name, "transformer_block_checkpointed_forward"))
