"""Copies through MoE layers: what Megatron keeps per call, per copy, and the routing losses formed
per copy so that, summed over the copies, they are Megatron's for the whole micro-batch.

* **The dispatcher's state.** Megatron's token dispatcher keeps a call's state on itself between its
  stages (splits, permutation maps, the probs); the copies take turns inside those stages. While a
  block's copies run forward, each MoE layer's ``token_dispatcher`` is a :class:`PerCopyDispatcher`:
  every attribute is read from and written to the running copy's own shallow copy of Megatron's
  dispatcher, whose methods run with it as ``self`` (the MoE wing's stages see one dispatcher per
  layer call). Megatron's dispatcher is back on the layer when the forward ends.
* **The routing losses** (``TopKRouter``, megatron-core 0.16+; patched while multi-copy is installed,
  acting only inside copies; the copies' sizes are equal, along the batch or the sequence):

  - the batch ``aux_loss`` (``E / (k T^2) * sum_i P_i f_i``, f_i the TP x CP group's token counts): the
    copies meet after their counts' all-reduce (scheduler.CopyRun.meet, a program point of every
    copy) and each forms its loss with every copy's counts and token totals summed, over its own
    probabilities; the copies' losses sum to Megatron's and each one's gradient is Megatron's on its
    tokens. Under full recompute it is formed in the chunks' recompute, again as copies taking turns
    (recompute.py), where they meet alike; under Megatron's own recompute (selective ``moe``, one
    copy at a time inside the backward), or a full recompute whose chunk function the copies have not read
    (:func:`_unread_recompute`, decided once per block), the block runs without copies, with the reason.
  - ``seq_aux_loss`` (a sum over whole sequences divided by the batch size): under a batch split each
    copy divides by the whole micro-batch's size; under a sequence split (copies hold parts of every
    sequence) the copies meet and combine each sequence's counts, as for the batch aux loss.
  - the z-loss (a mean over tokens): each copy's mean weighted by its share of the tokens, 1 / n.
  - the expert bias: ``local_tokens_per_expert`` is a sum; the copies add their counts.
  - the tracker's logged values (``get_moe_metrics_tracker`` / ``save_to_aux_losses_tracker``) add
    up: the copies' parts sum to Megatron's values.

Whatever does not decompose runs Megatron's block with its reason (:func:`block_reason`).
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import functools
import importlib
import inspect
import threading
import types
import weakref

import torch

from coc_inject import copy_context, mindspeed
from coc_inject.multi_copy import recompute, scheduler
from coc_inject.multi_copy.sequence import SEQUENCE

ROUTER_MODULE = "megatron.core.transformer.moe.router"
AUX_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss")
_patched: dict = {}  # router module -> True once its losses are patched for copies (install)
_combining = threading.local()  # .key: (loss, router) whose counts this copy's thread combines now
_kinds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # router -> its block's split kind (forward)
# A block recompute's chunk closure, after the recompute function's qualname, as recompute.BLOCK_CHUNKS names it.
CHUNK_CLOSURE = ".<locals>.custom.<locals>.custom_forward"


def moe_layers(block) -> list:
    return [layer.mlp for layer in getattr(block, "layers", ()) if "MoE" in type(getattr(layer, "mlp", None)).__name__]


# -- which MoE blocks run as copies -------------------------------------------------------------------

def _coeffs(router, config) -> dict:
    if hasattr(router, "get_aux_loss_coeff"):
        return {kind: router.get_aux_loss_coeff(kind) for kind in AUX_TYPES}
    kind = getattr(config, "moe_router_load_balancing_type", "none")
    return {kind: getattr(config, "moe_aux_loss_coeff", 0.0) or 0.0}


def _losses(layer) -> set:
    """The routing losses with a coefficient that ``layer``'s router forms (of AUX_TYPES)."""
    router = getattr(layer, "router", None)
    if router is None:
        return set()
    return {kind for kind, coeff in _coeffs(router, layer.config).items() if coeff and coeff > 0}


def _layer_reason(layer) -> str | None:
    config, router = layer.config, getattr(layer, "router", None)
    dispatcher = type(getattr(layer, "token_dispatcher", None)).__name__
    if dispatcher not in ("MoEAlltoAllTokenDispatcher", "MoEAllGatherTokenDispatcher"):
        return f"MoE layers with the {dispatcher} (its communication manager holds a call's state)"
    if hasattr(layer, "_inference_token_dispatcher"):
        return "MoE layers with Megatron's inference dispatcher (the layer swaps its dispatcher per call)"
    if router is None or getattr(router, "router_replay", None) is not None:
        return "MoE layers with router replay or no router"
    routing = getattr(router, "routing_type", "none")
    routing = routing if isinstance(routing, str) else ",".join(routing)
    if "sinkhorn" in routing or "quantile" in routing:
        return f"MoE layers with {routing} routing (balanced over the whole batch)"
    losses = _losses(layer)
    z_loss = getattr(config, "moe_z_loss_coeff", None) is not None
    if (losses or z_loss) and not _patched.get(type(router).__module__):
        return "MoE layers with routing losses on this megatron-core (its router forms them in one method; 0.16+)"
    if "global_aux_loss" in losses:
        return ("MoE layers with global_aux_loss (its running token count steps once per call: each copy "
                "would count as a micro-batch)")
    # The routing losses are formed where the router runs with grad: under recompute, in the recompute.
    # A full recompute's chunks are recomputed as copies taking turns (recompute.py), where the copies
    # meet; Megatron's own checkpoint (selective 'moe', distributed saved activations) recomputes one
    # copy's node at a time inside the copies' backward, where they cannot.
    one_at_a_time = (getattr(layer, "moe_layer_recompute", False)
                     or (getattr(config, "recompute_granularity", None) == "full"
                         and getattr(config, "distribute_saved_activations", False)))
    if "aux_loss" in losses and one_at_a_time:
        return ("MoE layers with the batch aux_loss under Megatron's own recompute (selective 'moe', or full "
                "with distribute_saved_activations: formed one copy at a time inside the backward, where the "
                "copies' token counts cannot be combined)")
    if z_loss and getattr(config, "calculate_per_token_loss", False):
        return "MoE layers with the z-loss and calculate_per_token_loss (the router scales it by the copy's tokens)"
    return None


def _chunk_recompute(block):
    """The function the block's forward hands its full recompute to (the chunks of layers it checkpoints): the
    block's ``_checkpointed_forward`` (megatron-core 0.12.1 to 0.16.1, MindSpeed's forward), or the module's
    ``checkpointed_forward`` (0.19); None where the forward names neither."""
    forward = inspect.unwrap(type(block).forward)  # under coc-inject's wrapper: Megatron's, or one read as it
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    if "_checkpointed_forward" in names:
        bound = getattr(block, "_checkpointed_forward", None)
        return getattr(bound, "__func__", bound)
    if "checkpointed_forward" in names:
        return getattr(forward, "__globals__", {}).get("checkpointed_forward")
    return None


def _unread_recompute(block, layers) -> str | None:
    """The batch aux_loss under a full recompute whose chunks the copies do not recompute as copies: the
    chunk's closure is not on recompute.BLOCK_CHUNKS (MindSpeed's --recompute-method block puts
    mindspeed.core.memory.common's _checkpointed_forward on the block), so Megatron's checkpoint recomputes
    it one copy at a time inside the copies' backward, where the copies cannot meet."""
    if getattr(block.config, "recompute_granularity", None) != "full":
        return None
    function = _chunk_recompute(block)
    if function is None:
        return None
    module, name = mindspeed.defined_in(function), getattr(function, "__qualname__", repr(function))
    if (module, f"{name}{CHUNK_CLOSURE}") in recompute.BLOCK_CHUNKS:  # its chunks recompute as copies
        return None
    if not any("aux_loss" in _losses(layer) for layer in layers):
        return None  # no meeting to hold: its chunks recompute one copy at a time, as before
    return (f"MoE layers with the batch aux_loss under a full recompute the copies have not read ({module}.{name}: "
            "its chunks are recomputed one copy at a time inside the backward, where the copies' token counts "
            "cannot be combined)")


def block_reason(block) -> str | None:
    """Why a block's MoE layers cannot run as copies (None: they can, or it has none); part of the block's
    verdict (forward.MultiCopy.decide: kept on the block, dropped by uninstall)."""
    layers = moe_layers(block)
    return (next(filter(None, map(_layer_reason, layers)), None)
            or (_unread_recompute(block, layers) if layers else None))


def call_reason(block, arguments: dict) -> str | None:
    """Why this call of an MoE block cannot run as copies."""
    if arguments.get("padding_mask") is not None and moe_layers(block):
        return "MoE layers with a padding mask (the router's means are over the valid tokens of every copy)"
    return None


# -- the dispatcher per copy --------------------------------------------------------------------------

class PerCopyDispatcher:
    """A layer's ``token_dispatcher`` while its block's copies run forward: each copy's own shallow
    copy of Megatron's dispatcher behind one object (module docstring)."""

    __slots__ = ("_coc_dispatcher", "_coc_copies")

    def __init__(self, dispatcher, n: int):
        object.__setattr__(self, "_coc_dispatcher", dispatcher)
        object.__setattr__(self, "_coc_copies", [copy_module.copy(dispatcher) for _ in range(n)])

    def _coc_own(self):
        index = scheduler.current_copy()
        return self._coc_dispatcher if index is None else self._coc_copies[index]

    @property
    def __class__(self):  # isinstance and super() see Megatron's class
        return type(self._coc_dispatcher)

    def __getattr__(self, name):
        own = self._coc_own()
        raw = inspect.getattr_static(type(own), name, None)
        if isinstance(raw, types.FunctionType) and name not in vars(own):
            return types.MethodType(raw, self)  # its state goes through this object to the copy's own
        return getattr(own, name)

    def __setattr__(self, name, value):
        setattr(self._coc_own(), name, value)

    def __delattr__(self, name):
        delattr(self._coc_own(), name)


@contextlib.contextmanager
def per_copy(block, split):
    """Each MoE layer of ``block`` with a :class:`PerCopyDispatcher` while inside, its router told the
    split's kind."""
    layers = moe_layers(block)
    held = [layer.__dict__.get("token_dispatcher") for layer in layers]
    for layer, dispatcher in zip(layers, held):
        layer.__dict__["token_dispatcher"] = PerCopyDispatcher(dispatcher, split.copies)
        _kinds[layer.router] = split.kind
    try:
        yield
    finally:
        for layer, dispatcher in zip(layers, held):
            layer.__dict__["token_dispatcher"] = dispatcher
            _kinds.pop(layer.router, None)


# -- the routing losses --------------------------------------------------------------------------------

def _copies():
    run = copy_context.current()
    return None if run is None or run.n < 2 else run


def _combined_counts(original):
    """get_tokens_per_expert_and_token_count: where a copy's loss combines the copies' counts (the batch
    aux loss; seq_aux_loss under a sequence split), every copy's summed."""
    @functools.wraps(original)
    def get_tokens_per_expert_and_token_count(*args, **kwargs):
        counted = original(*args, **kwargs)
        key, run = getattr(_combining, "key", None), _copies()
        if key is None or run is None:
            return counted
        every = run.meet(key, counted)
        if every is None:  # never silently wrong: block_reason keeps such blocks out
            raise RuntimeError(f"multi-copy: {key[0]} was formed where the copies cannot meet")
        return tuple(sum(parts[1:], parts[0]) for parts in zip(*every))
    return get_tokens_per_expert_and_token_count


@contextlib.contextmanager
def _combining_for(key):
    _combining.key = key
    try:
        yield
    finally:
        _combining.key = None


def _flagging(original):
    @functools.wraps(original)
    def _apply_aux_loss(self, *args, **kwargs):
        if _copies() is None:
            return original(self, *args, **kwargs)
        with _combining_for(("aux_loss", id(self))):
            return original(self, *args, **kwargs)
    return _apply_aux_loss


def _whole_batch(original):
    """seq_aux_loss: a batch split keeps sequences whole (each copy divides by the whole micro-batch);
    a sequence split combines each sequence's counts over the copies, as the batch aux loss does."""
    @functools.wraps(original)
    def _apply_seq_aux_loss(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, *args, **kwargs):
        run = _copies()
        if run is not None and _kinds.get(self) == SEQUENCE:
            with _combining_for(("seq_aux_loss", id(self))):
                return original(self, probs, scores_for_aux_loss, routing_map, seq_length, bsz, *args, **kwargs)
        return original(self, probs, scores_for_aux_loss, routing_map, seq_length,
                        bsz if run is None else bsz * run.n, *args, **kwargs)
    return _apply_seq_aux_loss


def _weighted_z_loss(original):
    @functools.wraps(original)
    def z_loss_func(*args, **kwargs):
        z_loss, run = original(*args, **kwargs), _copies()
        return z_loss if run is None else z_loss / run.n
    return z_loss_func


def install(patches) -> None:
    """Patch the router's losses for copies (0.16+: where TopKRouter forms each aux loss in a method
    of its own); on older releases MoE blocks with routing losses run without copies (block_reason)."""
    try:
        module = importlib.import_module(ROUTER_MODULE)
    except ImportError:
        return
    router = getattr(module, "TopKRouter", None)
    names = ("get_tokens_per_expert_and_token_count", "z_loss_func")
    if router is None or not all(hasattr(module, name) for name in names) or not all(
            hasattr(router, name) for name in ("_apply_aux_loss", "_apply_seq_aux_loss")):
        return
    patches.patch(module, names[0], _combined_counts(patches.original(module, names[0])))
    patches.patch(module, names[1], _weighted_z_loss(patches.original(module, names[1])))
    patches.patch(router, "_apply_aux_loss", _flagging(patches.original(router, "_apply_aux_loss")))
    patches.patch(router, "_apply_seq_aux_loss", _whole_batch(patches.original(router, "_apply_seq_aux_loss")))
    _patched[ROUTER_MODULE] = True


# -- auto's trials ---------------------------------------------------------------------------------------

def trial_group(block):
    """The group an MoE block's trials agree over: every rank its all-to-alls reach as well as its TP x
    CP group (tensor x data x context parallel: the expert groups are carved from it); None: no MoE."""
    if not moe_layers(block):
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)


@contextlib.contextmanager
def routers_as_found(block):
    """Trials of an MoE block leave its routers' buffers (token counts, expert bias) and Megatron's
    logged aux losses as found."""
    routers = [layer.router for layer in moe_layers(block) if getattr(layer, "router", None) is not None]
    buffers = [(b, b.detach().clone()) for r in routers for b in r.buffers()]
    tracker = {id(values): (values, values.detach().clone()) for values in _tracker_values()}
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in buffers:
                buffer.copy_(value)
            for values in _tracker_values():  # an entry the trials created starts from zero
                found = tracker.get(id(values))
                values.copy_(found[1]) if found is not None else values.zero_()


def _tracker_values() -> list:
    """Megatron's logged aux losses, one tensor per name (0.19's metrics tracker; 0.12 to 0.16's dict)."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        entries = [entry.values for entry in moe_utils.get_moe_metrics_tracker().metrics.values()]
    else:
        entries = [entry.get("values") for entry in layer_wise_tracker().values()]
    return [values for values in entries if isinstance(values, torch.Tensor)]


def layer_wise_tracker() -> dict:
    """Megatron's dict of logged aux losses before 0.19: moe_utils' (0.13 to 0.16) or parallel_state's (0.12)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "get_moe_layer_wise_logging_tracker",
                   getattr(parallel_state, "get_moe_layer_wise_logging_tracker", dict))()
