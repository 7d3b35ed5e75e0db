"""Multi-copy parallel on a real megatron-core GPT (local spec) on every rank of a gloo pool: the
same training with and without copies (tests/cp_gpt_cases.train, its model and step), each
collective every rank issued (op, group, shape, copy) recorded in order, and the routes told.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist

from coc_inject import copy_context, dist_interception
from coc_inject.multi_copy import forward as copies_forward, install as copies_install
from coc_inject.multi_copy import collectives as copies_collectives
from coc_inject.multi_copy import scheduler as copies_scheduler, segments
from coc_inject.multi_copy.cuts import KINDS
from tests.context_parallel import cp_gpt_cases
from tests.dist_harness import cpu_streams, reinitialize_model_parallel
from tests.fakes import recompute_rng

RECORDED = ("all_reduce", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor",
            "_reduce_scatter_base", "all_gather", "all_to_all_single", "batch_isend_irecv", "broadcast")


class CollectiveRecorder:
    """Every collective issued on this rank in order: (op, group ranks, shape, copy, left in flight).
    Entered before coc-inject's copies run (dist_interception nests), it sits beneath coc-inject's
    wrappers and sees the order collectives reach the network. It only observes: the copy is what
    production itself knows (scheduler.current_copy: the copy thread's, or the running node's)."""

    def __init__(self):
        self.calls: list = []
        self.backward: list = []  # per call: issued inside the copies' backward from one thread (segments.py)
        self._inside = contextlib.ExitStack()

    def __enter__(self):
        self._inside.enter_context(dist_interception.replaced(self._recording, RECORDED))
        return self

    def __exit__(self, *exc):
        self._inside.close()

    def _recording(self, name, original):
        parameters = list(inspect.signature(original).parameters)

        def record(*args, **kwargs):
            bound = dict(zip(parameters, args), **kwargs)
            group = bound.get("group")
            ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else "world"
            first = next(iter(bound.values()))
            shape = tuple(first.shape) if isinstance(first, torch.Tensor) else (
                [tuple(t.shape) for t in first] if isinstance(first, list) and first
                and isinstance(first[0], torch.Tensor) else None)
            run = copy_context.current()
            deferred = run is not None and run.defers(KINDS.get(name))  # left in flight past its node
            self.calls.append((name, ranks, shape, copies_scheduler.current_copy(), deferred))
            self.backward.append(isinstance(run, segments.Segmented))
            return original(*args, **kwargs)

        record.__wrapped__ = original  # coc-inject reads the signature through it
        return record


@contextlib.contextmanager
def autograd_on_one_thread():
    """While a block's copies run their backward, autograd refuses a call from any thread but the one
    running it (the stand-in for a device's engine thread, which no copy thread may call into);
    yields the calls made from it then."""
    import threading

    from torch.autograd import graph

    from coc_inject.multi_copy import segments

    original, backward, calls, inside = graph._engine_run_backward, segments.backward, [], []

    def guarded(*args, **kwargs):
        if inside and threading.get_ident() != inside[-1]:
            raise RuntimeError("autograd called from a second thread during the copies' backward")
        if inside:
            calls.append(1)
        return original(*args, **kwargs)

    def copies_backward(*args, **kwargs):
        inside.append(threading.get_ident())
        try:
            return backward(*args, **kwargs)
        finally:
            inside.pop()

    torch.autograd._engine_run_backward = graph._engine_run_backward = guarded  # backward() and grad() call it
    segments.backward = copies_backward
    try:
        yield calls
    finally:
        torch.autograd._engine_run_backward = graph._engine_run_backward = original
        segments.backward = backward


def train(copies=2, tp=2, cp=1, coc=None, chunks=None, record=False, tuner=None, poison=False, skip_cut_waits=False,
          **kwargs):
    """cp_gpt_cases.train with ``copies`` (1: off; "auto"), with ``chunks`` CoC's chunked linears,
    every wing installed for one config; the routes the blocks took come back as ``routes``.
    ``poison``: a collective left in flight reads NaN until its wait; ``skip_cut_waits``: the cuts do
    not wait for it (a deliberately broken backward, which poison must catch)."""
    from coc_inject import job
    from coc_inject.linears import install as linears
    from coc_inject.config import AUTO, CocConfig
    from megatron.core.transformer import transformer_block

    options = dict(coc or {}, multi_copy=AUTO if copies == "auto" else copies,
                   **({"parallel_num": chunks} if chunks is not None else {}))
    config = CocConfig(**options) if (coc or chunks is not None or copies != 1) else None

    def after_setup():
        if chunks is not None:
            assert linears.install(config)
        if copies != 1:
            copies_install.install(config, transformer_block)
            if tuner is not None:
                job.current().tuners[job.MULTI_COPY] = tuner

    if kwargs.get("recompute_granularity"):
        recompute_rng.install()
    recorder = CollectiveRecorder() if record else None
    with contextlib.ExitStack() as inside:  # left in the reverse order
        routes, autograd_calls = inside.enter_context(recorded_routes()), inside.enter_context(autograd_on_one_thread())
        inside.enter_context(_cut_waits(not skip_cut_waits))
        served = inside.enter_context(_served_gathers())
        if poison:
            inside.enter_context(copies_collectives.poisoned())
        if recorder is not None:
            inside.enter_context(recorder)
        inside.callback(job.uninstall)  # coc-inject's wrappers come off before the recorder's
        result = cp_gpt_cases.train(tp, cp, config, after_setup=after_setup, **kwargs)
    result["autograd_calls"] = len(autograd_calls)
    result["routes"] = sorted(set(routes), key=repr)
    result["backward_in_turn"] = sorted(why for why in routes.in_turn if why is not None)
    result["collectives"] = recorder.calls if recorder is not None else None
    result["in_backward"] = recorder.backward if recorder is not None else None
    result["gathers_served"] = len(served)
    return result


@contextlib.contextmanager
def _served_gathers():
    """The column linears' all-gathers the copies' backward served from a gather issued ahead."""
    from coc_inject.multi_copy import segments

    serve, served = segments.Segmented.serve, []

    def counting(run, *args):
        handle = serve(run, *args)
        if handle is not None:
            served.append(handle)
        return handle

    segments.Segmented.serve = counting
    try:
        yield served
    finally:
        segments.Segmented.serve = serve


@contextlib.contextmanager
def _cut_waits(on: bool):
    from coc_inject.multi_copy import segments

    complete = segments.Segmented.complete
    if not on:  # the cuts' waits do nothing; the run's final one still completes everything
        segments.Segmented.complete = lambda run, copy: None
    try:
        yield
    finally:
        segments.Segmented.complete = complete


@contextlib.contextmanager
def recorded_routes():
    """The (copies, reason) of every block call made inside, counted on into the coverage too;
    ``.in_turn``: the calls' reasons for a backward in turn (None: it overlaps)."""

    class Routes(list):
        in_turn: set

    routes = Routes()
    routes.in_turn = set()
    count = copies_forward.MultiCopy.count
    copies_forward.MultiCopy.count = lambda *call: (routes.append((call[2].copies, call[2].reason)),
                                                    routes.in_turn.add(call[2].backward_in_turn), count(*call))
    try:
        yield routes
    finally:
        copies_forward.MultiCopy.count = count


def skewed_tuner(delay, slow_baseline=False):
    """A tuner whose trials other than the baseline (with ``slow_baseline``: the baseline's) take
    ``delay`` seconds longer on this rank (a real delay)."""
    import time

    from coc_inject.config import CocConfig
    from coc_inject.tuning.online import Tuner

    tuner = Tuner(CocConfig(), None)
    decide = tuner.decide

    def skewed(key, group, device, candidates, baseline, run, group_name="TP", **kwargs):
        def trial(choice):
            tuner.runs[choice] = tuner.runs.get(choice, 0) + 1
            run(choice)
            if delay and (choice == baseline) == slow_baseline:
                time.sleep(delay)
        tuner.deciding = True
        try:
            return decide(key, group, device, candidates, baseline, trial, group_name, **kwargs)
        finally:
            tuner.deciding = False

    tuner.decide = skewed
    tuner.deciding = False
    tuner.runs = {}  # trial runs per candidate
    return tuner


def train_auto(skew=None, slow_baseline=False, **kwargs):
    """train() with COC_MULTI_COPY=auto; ``skew`` {rank: seconds} slows that rank's trials with copies
    (``slow_baseline``: its trials without copies)."""
    tuner = skewed_tuner((skew or {}).get(dist.get_rank()), slow_baseline)
    result = train(copies="auto", tuner=tuner, **kwargs)
    result["decisions"] = [{"key": key.text(), "choice": d.choice, "source": d.source}
                           for key, d in tuner.decisions.items()]
    result["trial_runs"] = dict(tuner.runs)
    return result


def train_linears_choice(slow_ranks=(0, 2), **kwargs):
    """Copies 2 with COC_PARALLEL_NUM=auto, the trials of the copies with CoC's chunks inside half a
    second slower on ``slow_ranks`` only: the decisions, and the reasons the CoC engine gave for
    running Megatron's path outside the trials, come back with the training."""
    from coc_inject.linears.router import LinearRouter
    from coc_inject.config import AUTO

    reasons = set()
    plan = LinearRouter.plan

    def recording(self, call):
        route = plan(self, call)
        if not tuner.deciding:
            reasons.add(getattr(route, "reason", None))
        return route

    LinearRouter.plan = recording
    tuner = skewed_tuner(0.5 if dist.get_rank() in slow_ranks else 0, slow_baseline=True)
    try:
        result = train(copies=2, chunks=AUTO, tuner=tuner, **kwargs)
    finally:
        LinearRouter.plan = plan
    result["decisions"] = [decision.choice for decision in tuner.decisions.values()]
    result["megatron_reasons"] = sorted(reason for reason in reasons if reason)
    return result


def train_pipeline(copies=2, steps=3, micro_batches=2, b=4, seq=64, vocab=128, hidden=64, layers=4):
    """TP 2 x PP 2 on 4 ranks, sequence parallel: each rank a real Megatron GPT stage (pre_process /
    post_process; stage 1's block reads Megatron's input tensor), run by a GPipe loop of this test's
    own -- Megatron's schedules and p2p communication allocate on "cuda" -- with the micro-batches'
    activations and gradients passed between the stages by send / recv. Losses (last stage) and
    parameters after ``steps`` SGD steps, the routes the blocks took."""
    from megatron.core import parallel_state
    from megatron.core.transformer import transformer_block

    from coc_inject import job
    from coc_inject.config import CocConfig

    cp_gpt_cases.setup(1, 1)
    tp = 2
    reinitialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=2)
    cp_gpt_cases._parallel_state_key = None  # the next setup initialises again
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    with recorded_routes() as routes, contextlib.ExitStack() as installed:
        installed.callback(job.uninstall)
        if copies != 1:
            copies_install.install(CocConfig(multi_copy=copies), transformer_block)
        model = cp_gpt_cases.build_gpt(tp, 1, hidden=hidden, layers=layers, seq=seq, vocab=vocab, sp=True,
                                       pre_process=first, post_process=last, pipeline_model_parallel_size=2,
                                       pipeline_dtype=torch.float32)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        tp_group = parallel_state.get_tensor_model_parallel_group()
        causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
        part = b // micro_batches
        losses = []
        for step in range(steps):
            tokens, labels = (t.split(part) for t in cp_gpt_cases.batch(step, b, seq, vocab))
            positions = torch.arange(seq).unsqueeze(0).expand(part, seq)
            optimizer.zero_grad(set_to_none=True)
            inputs, outputs = [], []
            for m in range(micro_batches):  # forward of every micro-batch, then their backward
                if first:
                    outputs.append(model(tokens[m], positions, causal))
                    dist.send(outputs[-1].detach(), parallel_state.get_pipeline_model_parallel_next_rank())
                else:
                    inputs.append(torch.empty(seq // tp, part, hidden))
                    dist.recv(inputs[-1], parallel_state.get_pipeline_model_parallel_prev_rank())
                    model.set_input_tensor(inputs[-1].requires_grad_())
                    outputs.append(model(None, positions, causal, labels=labels[m]).sum() / (b * seq))
            for m in range(micro_batches):
                if last:
                    outputs[m].backward()
                    dist.send(inputs[m].grad, parallel_state.get_pipeline_model_parallel_prev_rank())
                else:
                    grad = torch.empty_like(outputs[m])
                    dist.recv(grad, parallel_state.get_pipeline_model_parallel_next_rank())
                    outputs[m].backward(grad)
            for param in model.parameters():
                if param.grad is not None and getattr(param, "sequence_parallel", False):
                    dist.all_reduce(param.grad, group=tp_group)
            optimizer.step()
            losses.append(sum(o.item() for o in outputs) if last else 0.0)
    return {"losses": losses, "params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(), "first_stage": first,
            "routes": sorted(set(routes), key=repr)}


def train_fused(copies=2, **kwargs):
    """train() with USE_COC_FUSED_KERNEL=1 on CUDA symmetric memory's fused kernels -- the FAKE CPU
    kernels of tests/fakes/symm_mem_cpu.py, which check the call contract and compute with gloo --
    and the backward chunked in 4; how many fused kernel calls ran comes back too."""
    from tests.linears import fused_cases

    fused_cases.use_fakes(True, symm_mem=True)
    try:
        result = train(copies=copies, coc={"fused": True, "fused_backend": "symm_mem"}, chunks=4, **kwargs)
        result["fused_calls"] = len(fused_cases.fake_calls()["symm_mem"])
    finally:
        fused_cases.use_fakes(False)
    return result


def train_ddp(copies=2, steps=2, b=4, seq=32):
    """The GPT inside Megatron's DDP with overlap_grad_reduce (a parameter's gradient must be heard of
    once per micro-batch: 0.13-0.16 assert "Cannot set grad twice"; the copies' backward sums every
    copy's gradient into one AccumulateGrad run). Returns the losses and the reduced gradients (main_grad)
    of every step."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer import transformer_block

    from coc_inject import job
    from coc_inject.config import CocConfig

    streams = cpu_streams()
    streams.__enter__()
    cp_gpt_cases.setup(2, 1)
    if copies != 1:
        copies_install.install(CocConfig(multi_copy=copies), transformer_block)
    try:
        model = cp_gpt_cases.build_gpt(2, 1, seq=seq)
        ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            overlap_grad_reduce=True, use_distributed_optimizer=False, grad_reduce_in_fp32=True))
        losses, grads = [], []
        for step in range(steps):
            tokens, labels = cp_gpt_cases.batch(step, b, seq, 128)
            positions = torch.arange(seq).unsqueeze(0).expand(b, seq)
            mask = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool), diagonal=1)
            ddp.zero_grad_buffer()
            loss = ddp(tokens, positions, mask, labels=labels).sum() / (b * seq)
            loss.backward()
            ddp.finish_grad_sync()
            grads.append({name: p.main_grad.detach().clone() for name, p in model.named_parameters()})
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.5 * p.main_grad
            losses.append(loss.item())
        routes = sorted({repr(copies_forward.last_route(m)) for m in model.modules()
                         if type(m).__name__ == "TransformerBlock"})
    finally:
        job.uninstall()
        streams.__exit__(None, None, None)
    return {"losses": losses, "grads": grads, "routes": routes}


def train_cp_copies(**kwargs):
    """train() at CP > 1, with the sequence copies' CP attention calls (meeting_cp.attend) counted by
    algorithm as ``cp_copy_calls``."""
    from coc_inject.multi_copy import meeting_cp

    attend, calls = meeting_cp.attend, {}

    def counting(plan, *args, **more):
        name = plan.variants[0].describe()
        calls[name] = calls.get(name, 0) + 1
        return attend(plan, *args, **more)

    meeting_cp.attend = counting
    try:
        result = train(**kwargs)
    finally:
        meeting_cp.attend = attend
    result["cp_copy_calls"] = calls
    return result
