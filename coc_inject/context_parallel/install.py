"""install() / uninstall() of context parallelism on Megatron's local ``DotProductAttention``, and
the two post-import hooks that do it (registered by bootstrap).

* ``megatron.core.transformer.dot_product_attention``: ``__init__`` and ``forward`` of the exact
  class ``DotProductAttention`` are replaced by forward.py's (a subclass with its own
  ``__init__``/``forward`` keeps them); a layer built with CP = 1 runs Megatron's code unchanged, or
  with COC_FLASH_ATTN the fused attention kernel (Megatron's code for a call that kernel cannot run
  exactly, with a reason).
* ``megatron.core.parallel_state``: ``initialize_model_parallel`` also makes hybrid's Ulysses
  groups, where every rank passes; ``destroy_model_parallel`` destroys them (groups.py).

The attention's wing of the job's installation (coc_inject.job): patches, coverage and the
COC_CP_ALGO=auto tuner live there, shared with the linears' wing.
"""

from __future__ import annotations

from coc_inject import job, mindspeed
from coc_inject.context_parallel import banner, forward, groups


def install(config, attention_module=None, parallel_state=None) -> None:
    """Patch the attention class (and, when given, parallel_state) for ``config``, counting no
    calls (tests, ``coc-inject tune``; the import hooks count). Idempotent."""
    uninstall()
    _install(job.installation(config), attention_module, parallel_state)


def uninstall() -> None:
    """Undo the job's installation (Ulysses groups live until destroy_model_parallel)."""
    job.uninstall(forget_said=False)


def _install(installation, attention_module=None, parallel_state=None) -> None:
    patches = installation.patches
    if parallel_state is not None and _mindspeeds(parallel_state, "initialize_model_parallel"):
        parallel_state = None  # MindSpeed's CP makes its groups (hybrid's Ulysses ones too)
    if attention_module is not None and _mindspeeds(attention_module, "DotProductAttention"):
        attention_module = None
    if parallel_state is not None:
        initialize, destroy = "initialize_model_parallel", "destroy_model_parallel"
        patches.patch(parallel_state, initialize, groups.making_configured(
            patches.original(parallel_state, initialize), installation.config.cp_ulysses_degree, parallel_state))
        patches.patch(parallel_state, destroy, groups.releasing(patches.original(parallel_state, destroy)))
    if attention_module is not None:
        cls = attention_module.DotProductAttention
        patches.patch(cls, "__init__", forward.wrap_init(installation, cls, patches.original(cls, "__init__")))
        patches.patch(cls, "forward", forward.wrap_forward(installation, patches.original(cls, "forward")))


def _mindspeeds(owner, name: str) -> bool:
    """Whether MindSpeed's context parallelism already replaced ``owner.name`` (said once)."""
    feature = mindspeed.attribute_feature(owner, name, mindspeed.ATTENTION)
    if feature is not None:
        mindspeed.aside(mindspeed.ATTENTION, name, feature)
    return feature is not None


# -- the post-import hooks ----------------------------------------------------------------------


def _wanted():
    """The config when context parallelism is requested and this Megatron may be patched, else None."""
    config = job.config()
    if not config.attention_armed:
        return None
    return config if job.megatron_patchable(config) is not None else None


def on_parallel_state_imported(module) -> None:
    config = _wanted()
    if config is not None:
        _install(job.installation(config), parallel_state=module)


def on_attention_imported(module) -> None:
    config = _wanted()
    if config is None:
        return
    installation = job.installation(config)
    installation.armed_coverage()
    _install(installation, attention_module=module)
    if _mindspeeds(module, "DotProductAttention"):
        return  # the line naming MindSpeed's feature is said instead of the banner
    from megatron.core import parallel_state

    if banner.implicit(config):
        return  # armed because the linears are (COC_PARALLEL_NUM): said when a layer with CP > 1 is built
    initialized = parallel_state.model_parallel_is_initialized()
    banner.say(config, parallel_state.get_context_parallel_world_size() if initialized else None)
