"""Who issued a collective, in which phase, over which group: read from the caller's stack.

The **wing** is the innermost of coc-inject's wings on the stack (its engines issue the chunks, the
ring's exchanges, the pieces), unless Megatron's own code issued it first: then it is Megatron's
(``megatron tensor-parallel``, ``megatron moe``, ...), or multi-copy's where it ran inside copies (the
copies are what hides Megatron's mappings). coc-inject's own control traffic is ``coc-inject``; the
job's own collectives are ``job <module>`` (the job's module nearest the call). The interceptions in between (multi-copy's wrappers, the
bench's, this package's) are passed over. Only while measuring: a walk of ~30 frames per collective.
"""

from __future__ import annotations

import sys

from coc_inject import copy_context

# coc-inject's own control traffic (auto's cached-decision broadcast and its trials' barriers and MAX
# over ranks; the settings agreement goes through the store): never a wing's communication. First: it
# runs inside a wing's frames.
CONTROL = ("coc_inject.tuning", "coc_inject.timer", "coc_inject.pipeline.agreement")
OWN_TRAFFIC = "coc-inject"
WINGS = (("coc_inject.linears", "linears"), ("coc_inject.pipeline", "linears"),
         ("coc_inject.context_parallel", "context_parallel"), ("coc_inject.attention_kernels", "context_parallel"),
         ("coc_inject.moe", "moe"), ("coc_inject.multi_copy", "multi_copy"))
PASSED_OVER = ("coc_inject.measure", "coc_inject.dist_interception", "coc_inject.multi_copy.collectives",
               "coc_inject.testbed", "torch.")
MEGATRON = (("megatron.core.transformer.moe", "megatron moe"),
            ("megatron.core.tensor_parallel", "megatron tensor-parallel"),
            ("megatron.core.distributed", "megatron data-parallel"),
            ("megatron.core.optimizer", "megatron optimizer"),
            ("megatron.core.pipeline_parallel", "megatron pipeline"),
            ("megatron", "megatron other"))
# Megatron's expert groups: its collectives over them are the MoE layer's, whatever frame issued them.
EXPERT_GROUPS = ("ep", "etp", "tp-ep")
_DEPTH = 60


def issuer(depth: int = 2) -> str:
    """The wing (or Megatron's part) whose code made the collective call ``depth`` frames up. Megatron's
    part is the most specific of the Megatron frames up to the first that is not Megatron's: its MoE
    dispatcher calls the tensor-parallel mappings' all-to-all, which is the MoE layer's communication."""
    frame = sys._getframe(depth)
    owner = None  # the Megatron part found so far (its index in MEGATRON: lower = more specific)
    job = None  # the first module of the job's own code (neither Megatron's, coc-inject's nor torch's)
    for _ in range(_DEPTH):
        if frame is None:
            break
        name = frame.f_globals.get("__name__", "")
        if not name.startswith(PASSED_OVER):
            if name.startswith("megatron"):
                index = next(i for i, (prefix, _) in enumerate(MEGATRON) if name.startswith(prefix))
                owner = index if owner is None else min(owner, index)
            elif owner is not None:
                break  # Megatron's code made the call
            elif name.startswith(CONTROL):
                return OWN_TRAFFIC
            else:
                for prefix, wing in WINGS:
                    if name.startswith(prefix):
                        return wing
                if job is None and name and not name.startswith("coc_inject"):
                    job = name  # the job's own module nearest the call (its script is "__main__")
        frame = frame.f_back
    if copy_context.current() is not None:
        return "multi_copy"  # in copies: Megatron's collectives are the copies' to hide
    if owner is not None:
        return MEGATRON[owner][1]
    return f"job {job}" if job else "job"


OPTIMIZER_PARTS = ("megatron data-parallel", "megatron optimizer")


def phase(wing: str = "") -> str:
    """"backward" inside an autograd node (a full recompute's forward included); "optimizer" for
    Megatron's data-parallel and optimizer collectives outside one (the gradients' reduce after the
    backward, the parameters' gather); else "forward"."""
    import torch

    if torch._C._current_autograd_node() is not None:
        return "backward"
    return "optimizer" if wing in OPTIMIZER_PARTS else "forward"


GROUP_GETTERS = (("tp", "get_tensor_model_parallel_group"), ("cp", "get_context_parallel_group"),
                 ("ep", "get_expert_model_parallel_group"), ("etp", "get_expert_tensor_parallel_group"),
                 ("dp", "get_data_parallel_group"), ("pp", "get_pipeline_model_parallel_group"),
                 ("tp-cp", "get_tensor_and_context_parallel_group"), ("dp-cp", "get_data_parallel_group_with_cp"),
                 ("tp-ep", "get_expert_tensor_and_model_parallel_group"), ("embedding", "get_embedding_group"))


class GroupNames:
    """A process group's name in the job (Megatron's parallel state: "tp", "cp", "ep", ...), looked up
    once per group object; the world's "world", another one "group of N"."""

    def __init__(self):
        self._names: dict = {}

    def __call__(self, group) -> str:
        key = id(group)
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = self._lookup(group)
        return name

    @staticmethod
    def _lookup(group) -> str:
        import torch.distributed as dist

        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        state = sys.modules.get("megatron.core.parallel_state")
        for name, getter in GROUP_GETTERS if state is not None else ():
            try:
                if getattr(state, getter)() is group:
                    return name
            except Exception:  # noqa: BLE001 - a getter this release lacks or an uninitialised group
                continue
        try:
            return f"group of {dist.get_world_size(group)}"
        except Exception:  # noqa: BLE001
            return "group"
