"""The baton of multi-copy parallel on its own: copies run one at a time and hand over where they
would wait, in a fixed order; a failing copy stops the others; the copies' backward interleaves
them at their cuts on one thread."""

import threading

import pytest
import torch

from coc_inject import copy_context, job
from coc_inject.config import CocConfig
from coc_inject.multi_copy import install, scheduler


def test_copies_alternate_at_their_hand_overs_and_never_run_together():
    trace, running = [], []

    def copy(index, steps):
        def work():
            run = copy_context.current()
            for step in range(steps):
                running.append(index)
                assert len(running) == 1, "two copies ran at once"
                trace.append((index, step))
                running.pop()
                run.hand_over()
            return index * 10
        return work

    run = scheduler.CopyRun(2)
    assert run.run([copy(0, 3), copy(1, 2)]) == [0, 10]
    assert trace == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]


def test_a_key_met_twice_pairs_each_copys_ith_arrival_and_every_meeting_ends():
    """Issue 51 item 2: a copy reaching one meeting key once per MLP chunk meets the others' same arrival
    (before: its second arrival read the other copy's first value), copies leave in copy order, and
    no meeting is left behind."""
    met = []

    def copy(index):
        def work():
            run = copy_context.current()
            for chunk in range(3):
                met.append((index, chunk, run.meet(("aux_loss", 7), (index, chunk))))
                run.hand_over()
        return work

    run = scheduler.CopyRun(2)
    run.run([copy(0), copy(1)])
    assert [(index, chunk) for index, chunk, _ in met] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    assert all(every == [(0, chunk), (1, chunk)] for _, chunk, every in met), met
    assert run._meetings == {}


def test_a_failing_copy_stops_the_other_and_its_error_reaches_the_caller():
    def fails():
        copy_context.current().hand_over()
        raise ValueError("copy 0 broke")

    def waits_forever():
        while True:
            copy_context.current().hand_over()

    with pytest.raises(ValueError, match="copy 0 broke"):
        scheduler.CopyRun(2).run([fails, waits_forever])
    assert scheduler.CopyRun(2).run([lambda: "a", lambda: "b"]) == ["a", "b"]  # the kept threads serve on


def test_a_failure_in_a_copys_own_bookkeeping_reaches_the_caller_and_the_threads_serve_on():
    def save():  # the RNG save at a copy's end
        if threading.current_thread().name.startswith("coc-copy"):
            raise RuntimeError("save broke")

    with pytest.raises(RuntimeError, match="save broke"):
        scheduler.CopyRun(2, save=save, restore=lambda state: None).run([lambda: 1, lambda: 2])
    assert scheduler.CopyRun(2).run([lambda: 1, lambda: 2]) == [1, 2]


def test_copies_run_on_threads_kept_from_run_to_run_and_a_run_inside_a_copy_gets_its_own():
    """Kept threads: a new thread's allocator arena faults its memory in again at every block call
    (docs/multi-copy.md, "Costs")."""
    def thread():
        return threading.current_thread()

    first = scheduler.CopyRun(2).run([thread, thread])
    again = scheduler.CopyRun(2).run([thread, thread])
    assert again[0] is first[0] and again[1] is first[1] and first[0] is not first[1]

    def nested():
        return scheduler.CopyRun(2).run([thread, thread])

    inner = scheduler.CopyRun(2).run([nested, lambda: None])[0]
    assert len(set(inner)) == 2 and not set(inner) & set(first)


def test_a_kept_thread_takes_each_runs_autocast_and_grad_mode_not_the_last_ones():
    def state():
        return torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        assert scheduler.CopyRun(2).run([state, state]) == [(True, False)] * 2
    assert scheduler.CopyRun(2).run([state, state]) == [(False, True)] * 2


def test_copies_see_the_callers_context_variables_and_torchs_config_overrides():
    # torch keeps its config's user overrides in context variables (per thread): a job that sets
    # torch._dynamo.config.disable must not have torch.compile'd helpers compile inside its copies.
    import contextvars

    var = contextvars.ContextVar("caller", default="unset")

    def seen():
        value = var.get()
        var.set("changed in a copy")
        return value, torch._dynamo.config.disable

    token = var.set("the caller's")
    before = torch._dynamo.config.disable
    try:
        torch._dynamo.config.disable = not before
        assert scheduler.CopyRun(2).run([seen, seen]) == [("the caller's", not before)] * 2
        assert var.get() == "the caller's"  # a copy's change stays in the copy
    finally:
        torch._dynamo.config.disable = before
        var.reset(token)
    assert scheduler.CopyRun(2).run([seen, seen]) == [("unset", before)] * 2  # a kept thread: this run's


def test_a_forked_child_runs_copies_on_threads_of_its_own():
    import multiprocessing

    scheduler.CopyRun(2).run([lambda: None] * 2)  # the parent's threads exist
    child = multiprocessing.get_context("fork").Process(target=_copies_in_child)
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0, "copies in a forked child hung or failed"


def _copies_in_child():
    assert scheduler.CopyRun(2).run([lambda: 1, lambda: 2]) == [1, 2]


def test_copies_see_their_own_rng_state_and_the_caller_goes_on_from_copy_0s():
    from coc_inject import rng_state as rng

    torch.manual_seed(0)
    start = torch.get_rng_state()

    def draw():
        first = torch.rand(1)
        copy_context.current().hand_over()
        return first, torch.rand(1)

    run = scheduler.CopyRun(2, save=rng.save, restore=rng.restore)
    (a0, a1), (b0, b1) = run.run([draw, draw])
    after = torch.get_rng_state()
    torch.set_rng_state(start)
    want = torch.rand(2)
    assert (a0.item(), a1.item()) == tuple(want.tolist()) == (b0.item(), b1.item())
    assert torch.equal(after, torch.get_rng_state())


def test_install_patches_the_block_the_gather_mapping_and_the_memory_buffer_only():
    """Megatron's DDP needs no patch (its grad-ready count once per micro-batch: the copies' backward
    runs each AccumulateGrad once, tests/multi_copy/test_multi_copy.py's DDP case); nothing dead stays.
    The block's __init__ reads a forward another patcher put there since (tests/multi_copy/test_multi_copy.py's
    MindSpeed cases)."""
    from megatron.core import utils
    from megatron.core.tensor_parallel import layers
    from megatron.core.transformer import transformer_block

    install.install(CocConfig(multi_copy=2), transformer_block)
    try:
        patched = set(job.current().patches.patched())
    finally:
        job.uninstall()
    from megatron.core import tensor_parallel

    moe = {(owner, name) for owner, name in patched  # the MoE routers' losses per copy (multi_copy/moe.py)
           if ".moe." in getattr(owner, "__name__", "") + "." + getattr(owner, "__module__", "")}
    block = transformer_block.TransformerBlock
    assert patched - moe == {(block, "forward"), (block, "__init__"), (utils.GlobalMemoryBuffer, "get_tensor"),
                             (layers, "reduce_scatter_to_sequence_parallel_region"),
                             (tensor_parallel, "checkpoint")}, patched


def test_segmented_backward_interleaves_the_copies_at_their_cuts_on_one_thread():
    """Two copies of x -> [cut] -> *w -> [cut] -> *w: the backward runs copy 0's last segment, copy 1's,
    then each copy's cut (its wait) before its earlier segment, all on the calling thread; the
    gradients equal a plain backward's."""
    import threading

    from coc_inject.multi_copy import cuts, segments

    w = torch.tensor([1.5, -2.0], requires_grad=True)
    pieces = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([3.0, 4.0], requires_grad=True)]
    trace = []

    def copy(index):
        def work():
            h = pieces[index] * 2
            for layer in range(2):
                h = cuts.mark(h, cuts.REDUCE) * w
                h.grad_fn.register_prehook(lambda g, layer=layer: trace.append(
                    ("segment", index, layer, threading.get_ident())))
            return h
        return work

    run = scheduler.CopyRun(2)
    run.cuts = [[], []]
    outputs = run.run([copy(0), copy(1)])
    assert [len(c) for c in run.cuts] == [2, 2]
    for _, node, _ in run.cuts[0]:  # copy 0's cuts: where its collectives in flight are waited for
        node.register_prehook(lambda g: trace.append(("cut",)))
    grads = [torch.ones(2), torch.full((2,), 2.0)]
    got, _ = segments.backward(outputs, grads, pieces, run.cuts)
    steps = [(step[1], step[2]) if step[0] == "segment" else "cut0" for step in trace]
    assert steps == [(0, 1), (1, 1), "cut0", (0, 0), (1, 0), "cut0"], steps
    assert {step[3] for step in trace if step[0] == "segment"} == {threading.get_ident()}
    for index, piece in enumerate(pieces):
        want, = torch.autograd.grad(((piece * 2) * w * w * grads[index]).sum(), piece)
        assert torch.equal(got[index], want)
    assert torch.equal(w.grad, sum(((p * 2) * 2 * w * g).detach() for p, g in zip(pieces, grads)))


def test_copies_run_under_their_callers_grad_mode_and_saved_tensor_hooks():
    packed = []
    x = torch.ones(3, requires_grad=True)

    def work():
        return (x * x).requires_grad, torch.is_grad_enabled()

    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
        assert scheduler.CopyRun(2).run([work, work]) == [(True, True)] * 2
    assert len(packed) == 4  # x twice per copy: the pack hook ran inside the copies
    with torch.no_grad():
        assert scheduler.CopyRun(2).run([work, work]) == [(False, False)] * 2


def test_alone_keeps_the_baton_until_it_ends():
    trace = []

    def copy(index):
        def work():
            with copy_context.alone():
                trace.append((index, "trial"))
                copy_context.current().hand_over()  # suspended: no other copy runs here
                trace.append((index, "trial done"))
            copy_context.current().hand_over()
            trace.append((index, "after"))
        return work

    scheduler.CopyRun(2).run([copy(0), copy(1)])
    assert trace == [(0, "trial"), (0, "trial done"), (1, "trial"), (1, "trial done"), (0, "after"), (1, "after")]


def test_auto_tries_the_counts_that_divide_the_micro_batch_and_a_fixed_count_its_linears():
    from coc_inject.multi_copy import auto
    from coc_inject.multi_copy.splits import Split
    from coc_inject.routes import Inner, inside

    assert auto.candidates(2, True, False, rows=8) == [1, 2, 4]
    assert auto.candidates(2, True, True, rows=6) == [1, 2, inside(2, Inner(linears=False))]  # auto copies: with and without chunks
    assert auto.candidates(4, False, True, rows=8) == [4, inside(4, Inner(linears=False))]
    assert auto.candidates(2, False, False, rows=8) == [2]  # nothing to try
    assert auto.split_for(inside(4, Inner(linears=False)), Split(2, 8, ())) == Split(4, 8, (), Inner(linears=False))
    assert auto.split_for(1, Split(2, 8, ())) is None


def test_every_wing_on_auto_tries_each_tuned_wing_inside_the_copies_and_megatrons_path_instead():
    """#44 item 4: with the linears and the MoE pieces on auto, the copies are tried with each inside as
    it chose, with Megatron's path instead of either, and of both (copies alone): the block's choice
    covers the wings alone and together; the texts read back as what runs inside."""
    from coc_inject.multi_copy import auto
    from coc_inject.routes import AS_SET, Inner, copies_of, inner_of, inside

    got = auto.candidates(2, True, True, rows=4, experts_auto=True)
    inners = [AS_SET, Inner(linears=False), Inner(experts=False), Inner(False, False)]
    assert got == [1] + [inside(n, inner) for n in (2, 4) for inner in inners]
    assert got[1:5] == [2, "2 copies, Megatron's linears", "2 copies, Megatron's dispatcher",
                        "2 copies, Megatron's linears and dispatcher"]
    assert [(copies_of(c), inner_of(c)) for c in got[1:]] == [(n, inner) for n in (2, 4) for inner in inners]
    assert auto.candidates(2, False, False, rows=4, experts_auto=True) == [2, inside(2, Inner(experts=False))]


def test_no_trial_with_megatrons_dispatcher_inside_where_every_moe_layer_is_refused(monkeypatch):
    """A block whose MoE layers the MoE wing refuses (its construction: moe/guards.layer_reason) runs
    Megatron's dispatcher inside the copies either way: the candidates with it inside would repeat those
    without. Only a block with an MoE layer the wing accepts gets them."""
    import types

    from coc_inject.moe import guards
    from coc_inject.multi_copy import forward

    class MoELayer:  # lacks what the pieces read: refused ("MoELayer has no attribute 'config'")
        pass

    class Block:  # weakly referable, as a TransformerBlock is
        def __init__(self, *mlps):
            self.layers = [types.SimpleNamespace(mlp=mlp) for mlp in mlps]

    block = Block

    refused, dense = block(MoELayer(), MoELayer()), block(object())
    assert guards.layer_reason(refused.layers[0].mlp) is not None
    assert not forward._has_pieces_layer(refused) and not forward._has_pieces_layer(dense)
    accepted = block(MoELayer(), MoELayer())
    monkeypatch.setattr(guards, "layer_reason", lambda layer: None if layer is accepted.layers[1].mlp else "refused")
    assert forward._has_pieces_layer(accepted)


class FakeStream:
    def __init__(self, name, device_index):
        self.name, self.device_index = name, device_index

    def __repr__(self):
        return self.name


class FakeNpu:
    """torch.npu as torch_npu registers it, reduced to what the copies' threads carry: a per-thread
    current device and stream, and a per-thread generator state (torch_npu's are per device)."""

    def __init__(self):
        import threading

        self._thread = threading.local()
        self.calls = []

    def is_available(self):
        return True

    def is_initialized(self):
        return True

    def set_device(self, device):
        self.calls.append("set_device")
        self._thread.device = device

    def current_stream(self):
        device = getattr(self._thread, "device", 0)
        return getattr(self._thread, "stream", FakeStream(f"default stream of npu:{device}", device))

    def set_stream(self, stream):
        self.calls.append("set_stream")
        self._thread.stream = stream

    def get_rng_state(self):
        return torch.tensor([getattr(self._thread, "seed", 0)])

    def set_rng_state(self, state):
        self._thread.seed = int(state[0])

    def draw(self):
        self._thread.seed = getattr(self._thread, "seed", 0) + 1
        return self._thread.seed


def test_copies_carry_the_npu_device_stream_and_rng_state_as_cudas(monkeypatch):
    """Each copy thread runs on its caller's NPU device and stream (not device 0's default stream)
    and keeps its own NPU generator state between its turns; the caller goes on from copy 0's."""
    from coc_inject import rng_state as rng

    npu = FakeNpu()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    stream = FakeStream("stream 7 of npu:3", 3)
    npu.set_device(3)
    npu.set_stream(stream)
    npu.set_rng_state(torch.tensor([100]))

    def copy():
        seen = (npu._thread.device, npu.current_stream(), npu.draw())
        copy_context.current().hand_over()
        return seen + (npu.draw(),)

    got = scheduler.CopyRun(2, save=rng.save, restore=rng.restore).run([copy, copy])
    assert got == [(3, stream, 101, 102)] * 2
    assert npu.get_rng_state().item() == 102 and {"set_device", "set_stream"} <= set(npu.calls[2:])


def test_torch_distributed_is_wrapped_only_while_copies_run():
    """Installing multi-copy leaves torch.distributed and Megatron's aliases as they are; a copy run
    wraps them (shared by the threads running copies: out at the last one's end) and puts them back."""
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer import transformer_block

    from coc_inject.multi_copy import collectives

    originals = (dist.all_reduce, dist.batch_isend_irecv, mappings.dist_all_gather_func)
    install.install(CocConfig(multi_copy=2), transformer_block)
    try:
        assert (dist.all_reduce, dist.batch_isend_irecv, mappings.dist_all_gather_func) == originals
        with collectives.INTERCEPTION.entered():
            wrapped = (dist.all_reduce, dist.batch_isend_irecv, mappings.dist_all_gather_func)
            assert all(w is not o and w.__wrapped__ is o for w, o in zip(wrapped, originals))
            with collectives.INTERCEPTION.entered():  # a second thread's run
                assert dist.all_reduce is wrapped[0]
            assert dist.all_reduce is wrapped[0]  # the first run still runs
        assert (dist.all_reduce, dist.batch_isend_irecv, mappings.dist_all_gather_func) == originals
    finally:
        job.uninstall()


def test_every_collective_function_of_torch_is_replaced_or_said_why_not():
    """#44 item 1: one list of collectives for multi-copy's interception, the meter and the compute-only
    twin (dist_interception.EVERY_COLLECTIVE); every collective function this torch offers is on it or on
    NOT_REPLACED with the reason -- the chunked linears' all_gather_single / reduce_scatter_single were
    missing from the copies' interception, so their waits inside a copy kept the turn."""
    import re

    import torch.distributed as dist

    from coc_inject import dist_interception
    from coc_inject.multi_copy import cuts

    offered = {name for name in dir(dist) if callable(getattr(dist, name)) and not name[0].isupper()
               and re.search(r"all_|reduce|gather|scatter|broadcast|send|recv|barrier|to_all", name)}
    listed = set(dist_interception.EVERY_COLLECTIVE) | set(dist_interception.NOT_REPLACED)
    assert offered <= listed, f"collectives of torch.distributed on neither list: {sorted(offered - listed)}"
    assert not set(dist_interception.EVERY_COLLECTIVE) & set(dist_interception.NOT_REPLACED)
    for name in ("all_gather_single", "reduce_scatter_single"):
        if hasattr(dist, name):  # the copies intercept the forms the chunked pipeline issues, by kind
            assert name in dist_interception.EVERY_COLLECTIVE and name in cuts.KINDS


def test_async_op_is_found_where_the_function_in_place_takes_it():
    """Another tool's wrapper in torch.distributed's place (the compute-only twin's no-op, a profiler's
    ``call(*args, async_op=False, **kwargs)``) takes async_op by keyword only: the copies' wrapper and the
    meter then read it from the keywords, never from a positional tensor (the copies over the twin failed
    with "Boolean value of Tensor with more than one value is ambiguous")."""
    import functools

    import torch
    import torch.distributed as dist

    from coc_inject import dist_interception
    from coc_inject.multi_copy import collectives

    def keyword_only(*args, async_op=False, **kwargs):
        return ("handle", args) if async_op else None

    @functools.wraps(dist.all_reduce)
    def wrapping(*args, **kwargs):  # a wrapper naming its original: read through __wrapped__
        return None

    assert dist_interception.async_op_index(dist.all_reduce) == 3
    assert dist_interception.async_op_index(wrapping) == 3
    assert dist_interception.async_op_index(keyword_only) is None
    tensor = torch.ones(4)
    assert not dist_interception.is_async(None, (tensor, tensor), {})
    assert dist_interception.is_async(None, (tensor, tensor), {"async_op": True})
    assert dist_interception.is_async(3, (tensor, None, None, True), {})
    assert dist_interception.made_async(3, (tensor, None, None, False), {}) == (False, (tensor, None, None, True), {})
    assert dist_interception.made_async(3, (tensor,), {"async_op": False}) == (False, (tensor,), {"async_op": True})

    class Run:  # a copy's run: every collective started asynchronously, its handle taken as it is
        def defers(self, kind):
            return False

        def handle(self, work):
            return work

    wrapped = collectives.wrap(keyword_only)
    entered = copy_context_entered(Run())
    try:
        assert wrapped(tensor, tensor, async_op=True) == ("handle", (tensor, tensor))
    finally:
        entered()


def copy_context_entered(run):
    from coc_inject import copy_context

    copy_context.enter(run, 0)
    return copy_context.leave
