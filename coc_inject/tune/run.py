"""``coc-inject tune``: make ``COC_PARALLEL_NUM=auto``'s and ``COC_CP_ALGO=auto``'s decisions ahead of a job.

    coc-inject tune --hidden 4096 --ffn 11008 --seq 4096 --micro-batch 1 --tp 2 --sequence-parallel
    coc-inject tune --shape row-sp:4096,2048,4096 --shape column-sp:4096,4096,5504 --tp 2
    coc-inject tune --hidden 4096 --ffn 11008 --seq 32768 --micro-batch 1 --heads 32 --tp 2 --cp 2
    coc-inject tune --shape attention:32768,1,32,8,128 --cp 4       # the core attention alone, TP 1
    coc-inject tune --shape moe:4096,4096,1408,64,8 --ep 8           # an MoE layer (COC_MOE_OVERLAP=auto), TP 1
    torchrun --nproc-per-node 8 -m coc_inject tune --tp 8 ...      # on the job's devices
    torchrun --nproc-per-node 8 -m coc_inject tune --tp 4 --cp 2 ...

Each shape runs once, forward and backward, through the real megatron-core layer with CoC
installed as ``COC_PARALLEL_NUM=auto`` would install it, so the engine's own tuner makes the
decision (its trials: Megatron's path and each candidate chunk count, max over the ranks) and
writes it to the tune cache, exactly as a job's first call would. A job with the same decision
key and hardware identity (device or host, world size, TP or CP size, backend) then takes it from the
cache and runs no trials. Printed: a table (shape -> chosen N, each candidate's time) and the
equivalent ``COC_CUSTOMIZED`` for jobs that do not use ``auto``.

With ``--cp`` >= 2 the attention shapes (``--shape attention:...``, or the model dimensions with
``--heads``) are decided too, through Megatron's local attention with ``COC_CP_ALGO=auto``
(coc_inject.tune.attention); Megatron's parallel state gets the job's TP and CP sizes
(under torchrun give ``--tp`` with ``--cp``: the rest of the job may be data-parallel). MoE layer shapes
(``--shape moe:...`` with ``--ep``) tune in a run of their own (coc_inject.tune.moe).

Where it runs is ``coc-inject bench``'s choice: local CPU ranks over gloo (``--world``, default
``--tp`` x ``--cp``), or, under torchrun, every rank of the job on its device (``COC_BENCH_DEVICE=npu`` on
Ascend). Model dimensions map to the GPT layer's four tensor-parallel linears; ``m`` is
``seq / CP x micro-batch`` (all of a CP rank's rows, also under sequence parallelism).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass

from coc_inject import job, log
from coc_inject.linears import install as linears
from coc_inject.linears.guards import tp_group
from coc_inject.testbed import ranks
from coc_inject.tune import attention as tune_attention, moe as tune_moe, report as tune_report
from coc_inject.testbed.ranks import Setup
from coc_inject.config import AUTO, ConfigError, load_config, parse_tune_cache, parse_tune_candidates
from coc_inject.routes import CASE_NAMES, LayerCase

CASES = CASE_NAMES
SHAPE_ALLOWED = (f"CASE:M,K,N with CASE one of {', '.join(CASES)} and M, K, N integers >= 1 "
                 "(the engine's [m, k, n]: Row k = input size / TP; Column m = all rows, n = output size / TP)")
MODEL_OPTIONS = ("hidden", "ffn", "seq", "micro_batch")
# Variables whose settings tune replaces (auto everywhere, trials on, no report).
SET_BY_TUNE = ("COC_DISABLE", "COC_PARALLEL_NUM", "COC_CP_ALGO", "USE_COC_FUSED_KERNEL", "COC_CUSTOMIZED",
               "COC_DETERMINISTIC", "COC_ENABLE_IN_COLUMN_BACKWARD", "COC_REPORT", "COC_MOE_OVERLAP")


@dataclass(frozen=True)
class Target:
    """One layer shape to tune: the engine's case and [m, k, n]; ``batch`` shapes its input."""

    layer: str
    case: str
    m: int
    k: int
    n: int
    batch: int = 1

    @property
    def shape(self) -> tuple:
        return self.m, self.k, self.n


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_shape(text: str):
    """A Target, or a tune_attention.AttentionTarget for ``attention:...``."""
    case, _, dims = text.partition(":")
    case, words = case.strip(), dims.split(",")
    numbers = [int(w) for w in words if w.strip().isascii() and w.strip().isdigit() and int(w) >= 1]
    if case == "attention" and len(numbers) == len(words) == 5:
        return tune_attention.AttentionTarget("--shape", *numbers)
    if case == "moe" and len(numbers) == len(words) == 5:
        return tune_moe.MoETarget("--shape", *numbers)
    if case in CASES and len(numbers) == len(words) == 3:
        return Target("--shape", case, *numbers)
    allowed = (tune_attention.SHAPE_ALLOWED if case == "attention" else tune_moe.SHAPE_ALLOWED if case == "moe" else
               SHAPE_ALLOWED if case in CASES else
               f"{SHAPE_ALLOWED}; or {tune_attention.SHAPE_ALLOWED}; or {tune_moe.SHAPE_ALLOWED}")
    raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {allowed}")  # argparse names --shape


def positive(text: str) -> int:
    if not (text.strip().isascii() and text.strip().isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected an integer >= 1")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coc-inject tune", description=log.help_text(__doc__.split("\n\n")[0]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=log.help_text("\n\n".join(__doc__.split("\n\n")[1:])))
    shapes = parser.add_argument_group("explicit shapes")
    shapes.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="CASE:M,K,N",
                        help=f"repeatable; {SHAPE_ALLOWED}; or {tune_attention.SHAPE_ALLOWED}; or "
                             f"{tune_moe.SHAPE_ALLOWED}")
    model = parser.add_argument_group("model dimensions (GPT layer: linear_qkv, linear_proj, linear_fc1, "
                                      "linear_fc2)")
    model.add_argument("--hidden", type=positive, help="hidden size")
    model.add_argument("--ffn", type=positive, help="FFN hidden size")
    model.add_argument("--seq", type=positive, help="sequence length")
    model.add_argument("--micro-batch", type=positive, help="micro-batch size")
    model.add_argument("--heads", type=positive, help="attention heads (needed with --num-query-groups and --cp)")
    model.add_argument("--num-query-groups", type=positive, help="GQA groups: linear_qkv has "
                       "hidden + 2 * groups * hidden/heads outputs (default: MHA, 3 * hidden)")
    model.add_argument("--swiglu", action="store_true", help="gated linear unit: linear_fc1 has 2 * ffn outputs")
    model.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=False,
                       help="as Megatron's --sequence-parallel (default off, as in Megatron)")
    model.add_argument("--column-backward", action="store_true",
                       help="without sequence parallelism, also tune linear_qkv/linear_fc1 (their CoC runs only "
                            "with COC_ENABLE_IN_COLUMN_BACKWARD=1)")
    model.add_argument("--recompute-activations", action="store_true",
                       help="as Megatron's flag (selective recompute of the core attention): its first call "
                            "runs without autograd, so the forward-only attention key is tuned too")
    where = parser.add_argument_group("where and how")
    where.add_argument("--tp", type=positive, help="tensor-parallel size (default: 2 local ranks, 1 with --cp; "
                       "under torchrun the whole job, and required with --cp)")
    where.add_argument("--cp", type=positive, default=1, help="context-parallel size (default 1); >= 2 also tunes "
                       "the attention shapes (COC_CP_ALGO=auto)")
    where.add_argument("--ep", type=positive, help="expert-parallel size of the moe: shapes (default 2; TP 1, "
                       "an MoE tune runs on its own)")
    where.add_argument("--attention-mask", choices=["causal", "none"], default="causal",
                       help="the attention layers' mask type (default causal, as a GPT's)")
    where.add_argument("--world", type=positive, help="local ranks to start (default --tp x --cp); a multiple of it. "
                       "The cache identity includes the world size: use your job's. Not under torchrun")
    where.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    where.add_argument("--candidates", metavar="C,C,...",
                       help="CoC chunk counts tried beside N=1 (default: COC_TUNE_CANDIDATES, else 2,4,8)")
    where.add_argument("--cache", metavar="PATH|off",
                       help="tune cache to write (default: COC_TUNE_CACHE, else "
                            "${XDG_CACHE_HOME:-~/.cache}/coc-inject/tune.json); off: keep nothing")
    where.add_argument("--threads", type=positive, default=1, help="torch threads per local CPU rank")
    where.add_argument("--json", action="store_true", help="print the result as one JSON document (the decisions "
                       "per shape with the candidates' times, the cache, warnings, the fixed settings) instead of "
                       "the tables")
    return parser


def model_targets(args, tp: int, error, cp: int = 1) -> tuple[list, list]:
    """The GPT layer's Targets for the model dimensions (none given: none); and notes. Each CP rank's
    linears see seq / CP tokens."""
    given = [name for name in MODEL_OPTIONS if getattr(args, name) is not None]
    if not given:
        for name in ("heads", "num_query_groups"):
            if getattr(args, name) is not None:
                error(f"{_option(name)}={getattr(args, name)} needs the model dimensions "
                      f"{', '.join(map(_option, MODEL_OPTIONS))}")
        return [], []
    missing = [_option(name) for name in MODEL_OPTIONS if name not in given]
    if missing:
        error(f"model dimensions need {', '.join(missing)} as well (given: {', '.join(map(_option, given))})")

    def multiple_of_tp(name, value, what="--tp"):
        if value % tp:
            error(f"{name}={value} is invalid: expected a multiple of {what} ({tp})")

    hidden, ffn = args.hidden, args.ffn
    multiple_of_tp("--hidden", hidden)
    multiple_of_tp("--ffn", ffn)
    qkv = 3 * hidden
    if args.num_query_groups is not None and args.heads is None:
        error(f"--num-query-groups={args.num_query_groups} needs --heads (its kv channels are hidden / heads)")
    if args.heads is not None:
        if hidden % args.heads:
            error(f"--heads={args.heads} is invalid: expected a divisor of --hidden ({hidden})")
        multiple_of_tp("--heads", args.heads)
        groups = args.num_query_groups or args.heads
        if args.heads % groups:
            error(f"--num-query-groups={groups} is invalid: expected a divisor of --heads ({args.heads})")
        multiple_of_tp("--num-query-groups", groups)
        qkv = hidden + 2 * groups * (hidden // args.heads)
    if cp > 1 and args.seq % (2 * cp):
        error(f"--seq={args.seq} is invalid: expected a multiple of 2 x --cp ({2 * cp}): Megatron's context-parallel "
              "layout cuts the sequence into 2*CP equal chunks")
    m = args.seq // cp * args.micro_batch
    sp = args.sequence_parallel
    if sp and (args.seq // cp) % tp:
        sizes = "--tp" if cp == 1 else "--tp x --cp"
        error(f"--seq={args.seq} is invalid: expected a multiple of {sizes}, with --sequence-parallel ({tp * cp})")
    row, column = (LayerCase.ROW_SP, LayerCase.COLUMN_SP) if sp else (LayerCase.ROW, LayerCase.COLUMN_BWD)
    fc1 = (2 if args.swiglu else 1) * ffn
    layers = [("linear_qkv", column, m, hidden, qkv // tp), ("linear_proj", row, m, hidden // tp, hidden),
              ("linear_fc1", column, m, hidden, fc1 // tp), ("linear_fc2", row, m, ffn // tp, hidden)]
    notes = []
    if not sp and not args.column_backward:
        layers = [layer for layer in layers if layer[1] != LayerCase.COLUMN_BWD]
        notes.append("linear_qkv, linear_fc1: without sequence parallelism a column-parallel forward has no "
                     "communication and CoC leaves them to Megatron unless COC_ENABLE_IN_COLUMN_BACKWARD=1 "
                     "(--column-backward tunes them)")
    return [Target(name, case, m, k, n, args.micro_batch) for name, case, m, k, n in layers], notes


@dataclass(frozen=True)
class Plan:
    """What one tune run decides, and where."""

    targets: list  # Targets (the tensor-parallel linears)
    attention: list  # tune_attention.AttentionTargets
    notes: list
    config: object  # CocConfig: auto everywhere, the job's other settings
    tp: int
    cp: int
    world: int
    dtype: str = "float32"
    forward_only_too: bool = False  # --recompute-activations: the attention's forward-only keys as well
    moe: tuple = ()  # tune_moe.MoETargets (a run of their own)
    ep: int = 1


def resolve(args, parser, environ) -> Plan:
    """The Plan of the arguments, or a parser error."""
    moe = tuple(t for t in args.shape if isinstance(t, tune_moe.MoETarget))
    if moe or args.ep is not None:
        return resolve_moe(args, parser, environ, moe)
    under_torchrun = "RANK" in environ
    if under_torchrun and args.world is not None:
        parser.error(f"--world={args.world} is for local ranks: under torchrun the job's WORLD_SIZE "
                     f"({environ.get('WORLD_SIZE')}) is the world")
    cp = args.cp
    world_now = int(environ.get("WORLD_SIZE", "1")) if under_torchrun else None
    if world_now is not None and cp > 1 and args.tp is None:
        # The rest of a job may be data- or pipeline-parallel: the heads per rank depend on TP.
        parser.error(f"--cp={cp} under torchrun needs --tp (the job's tensor-parallel size)")
    tp = args.tp or (world_now if world_now else 2 if cp == 1 else 1)
    world = world_now or args.world or tp * cp
    if world % (tp * cp):
        if cp == 1:
            parser.error(f"--tp={tp} is invalid: expected a divisor of the world size ({world})")
        where = f"--world={world}" if args.world is not None else f"the world size {world} (WORLD_SIZE)"
        parser.error(f"{where} is invalid with --tp={tp} --cp={cp}: expected a multiple of --tp x --cp ({tp * cp})")
    shapes = [t for t in args.shape if isinstance(t, Target)]
    attention = [t for t in args.shape if not isinstance(t, Target)]
    targets, notes = model_targets(args, tp, parser.error, cp)  # also checks the dimensions model_target reads
    if cp > 1 and any(getattr(args, name) is not None for name in MODEL_OPTIONS):
        if args.heads is None:
            parser.error(f"--cp={cp} with the model dimensions needs --heads (the attention's heads)")
        attention.insert(0, tune_attention.model_target(args))
    if tp < 2 and (shapes or not attention):
        default = " (with --cp, TP defaults to 1: give the job's --tp)" if args.tp is None else ""
        parser.error(f"--tp={tp} is invalid: expected an integer >= 2 (TP 1 has no collective to overlap){default}")
    if tp < 2 and targets:
        targets, notes = [], ["TP 1: the linears have no collective to overlap; only the attention is tuned"]
    for target in shapes:
        if LayerCase(target.case).sequence_parallel and target.m % tp:
            parser.error(f"--shape={target.case}:{target.m},{target.k},{target.n} is invalid: m={target.m} is "
                         f"not a multiple of --tp ({tp}) (sequence parallelism splits the rows over the TP ranks)")
    targets += shapes
    if attention and cp < 2:
        parser.error(f"--shape attention:... needs --cp >= 2 (got --cp={cp}): at CP 1 the attention is Megatron's own")
    for target in attention:
        if target.layer == "--shape":
            tune_attention.check_shape(target, tp, cp, parser.error)
    for option, given in (("--attention-mask=none", args.attention_mask == "none"),
                          ("--recompute-activations", args.recompute_activations)):
        if given and not attention:
            parser.error(f"{option} is for attention shapes: they need --cp >= 2 (and --shape attention:... or the "
                         "model dimensions with --heads)")
    if args.attention_mask == "none":
        attention = [dataclasses.replace(t, causal=False) for t in attention]
    if not targets and not attention:
        parser.error("nothing to tune: give --shape CASE:M,K,N (repeatable) and/or the model dimensions "
                     f"{', '.join(map(_option, MODEL_OPTIONS))}")
    # COC_CP_WINDOW etc. refine an algorithm that is set
    base, cache = job_settings(args, parser, environ, {"COC_CP_ALGO": "auto"})
    try:
        candidates = (parse_tune_candidates("--candidates", args.candidates) if args.candidates is not None
                      else base.tune_candidates)
    except ConfigError as error:
        parser.error(str(error))
    if attention and base.cp_mask_type == "causal" and args.attention_mask == "none":
        parser.error("--attention-mask=none disagrees with COC_CP_MASK_TYPE=causal (the job's setting)")
    config = dataclasses.replace(base, parallel_num=AUTO, fused=False, customized_coc=(), disabled=False,
                                 deterministic=False, enable_coc_in_column_backward=True, tune_cache=cache,
                                 tune_candidates=candidates, report=None)
    return Plan(targets, attention, notes, config, tp, cp, world, args.dtype, args.recompute_activations)


def job_settings(args, parser, environ, extra: dict | None = None) -> tuple:
    """(the job's CocConfig, the tune cache to write). The job's other COC_* settings
    (COC_RECOMPUTE_ALL_GATHER, COC_CP_WINDOW, COC_CONFIG, ...) shape the trials as they shape its
    calls; those tune sets itself are not read."""
    try:
        base = load_config({**{name: value for name, value in environ.items() if name not in SET_BY_TUNE},
                            **(extra or {})})
        cache = base.tune_cache
        if args.cache is not None:
            text = args.cache if args.cache.strip().lower() == "off" else os.path.abspath(args.cache)
            cache = parse_tune_cache("--cache", text)
    except ConfigError as error:
        parser.error(str(error))
    return base, cache


def resolve_moe(args, parser, environ, moe: tuple) -> Plan:
    """The Plan of an MoE tune: only moe: shapes, EP ``--ep`` (default 2), TP 1."""
    if not moe:
        parser.error(f"--ep={args.ep} is for --shape moe:... shapes (none given)")
    others = [t.text() if hasattr(t, "text") else f"{t.case}:{t.m},{t.k},{t.n}" for t in args.shape if t not in moe]
    if others or any(getattr(args, name) is not None for name in MODEL_OPTIONS) or args.cp > 1:
        parser.error(f"--shape moe:... tunes in a run of its own (expert parallelism, TP 1): tune "
                     f"{', '.join(others) or 'the model dimensions / --cp'} in another run")
    ep = args.ep or 2
    if ep < 2:
        parser.error(f"--ep={ep} is invalid: expected an integer >= 2 (EP 1 has no all-to-all to overlap)")
    world = int(environ["WORLD_SIZE"]) if "RANK" in environ else args.world or ep
    if world % ep:
        parser.error(f"the world size {world} is invalid with --ep={ep}: expected a multiple of it")
    for target in moe:
        tune_moe.check_shape(target, ep, parser.error)
    base, cache = job_settings(args, parser, environ)
    config = dataclasses.replace(base, moe_overlap="auto", disabled=False, deterministic=False, tune_cache=cache,
                                 report=None)
    return Plan([], [], [], config, 1, 1, world, args.dtype, moe=moe, ep=ep)


def tune_rank(plan: Plan, device) -> dict | None:
    """Every rank: each distinct target once, fwd+bwd, with auto installed; rank 0 returns the
    decisions and the hardware identity they are cached under."""
    import torch  # torch and Megatron only in the ranks: tune's argument errors come without them
    import torch.distributed as dist

    log.configure(plan.config.log_level)  # rank 0 logs each decision as it is made
    dtype = getattr(torch, plan.dtype)
    measured = {"linears": _tune_linears(plan, dtype, device) if plan.targets else None,
                "attention": (tune_attention.tune_rank(plan.attention, plan.config, dtype, device, plan.tp, plan.cp,
                                                       plan.forward_only_too)
                              if plan.attention else None),
                "moe": tune_moe.tune_rank(plan.moe, plan.config, dtype, device, plan.ep) if plan.moe else None}
    return measured if dist.get_rank() == 0 else None


def _tune_linears(plan, dtype, device) -> dict:
    import torch  # as in tune_rank: only in the ranks

    from coc_inject.testbed.models import LINEARS, build_linear
    from coc_inject.tuning.online import hardware_identity

    linears.install(plan.config)
    try:
        seen = set()
        for target in plan.targets:
            if (target.case, target.shape) in seen:
                continue  # same decision key: decided once
            seen.add((target.case, target.shape))
            layer, x = build_linear(LINEARS[target.case], *target.shape, dtype, device, target.batch)
            out, _ = layer(x.requires_grad_(True))
            out.backward(torch.ones_like(out))
            group = tp_group(layer)
            del layer, x, out
        decisions = dict(job.current().decisions(job.LINEARS))
    finally:
        linears.uninstall()
    return {"decisions": decisions, "identity": hardware_identity(device, group)}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    plan = resolve(args, parser, os.environ)
    # Megatron's parallel state gets the job's TP and CP sizes. No link: the cache identity is the
    # host's, and an emulated link would be cached as plain loopback.
    setup = Setup(world=plan.world, threads=args.threads, tp=plan.tp, cp=plan.cp, ep=plan.ep,
                  command="coc-inject tune")
    measured = ranks.run(setup, tune_rank, plan)
    if measured is None:
        return 0  # not rank 0 of a torchrun job
    result = tune_report.result(plan, measured, tune_report.describe_where(plan, args.threads))
    print(json.dumps(result, indent=1) if args.json else tune_report.text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
