"""``coc-inject bench``: unpatched Megatron vs CoC through the real layers, in one run.

Where it runs:
* default: 2 local CPU ranks (gloo) over plain loopback;
* ``--link 1gbit``: the 2 ranks in two network namespaces joined by a rate-limited veth pair,
  each pinned to its own core (root; see coc_inject.bench.link);
* under ``torchrun`` (RANK/WORLD_SIZE set): every rank of the job on its device (CUDA/NPU,
  NCCL/HCCL), timed with device events.

Variants: unpatched Megatron, each ``--chunks`` count, and ``auto`` (``COC_PARALLEL_NUM=auto``
with a fresh temporary tune cache: its trials run once before the timed repetitions, which
then measure the N it chose; see coc_inject.bench.layers).

Writes a table to stdout, ``bench.json`` (raw per-repetition times and the figures) and
``bench.png`` (speedup vs N per case, timeline of one call) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

TARGETS = ("speedup >= 1.35 at the best N and >= 90% of the ideal saving (Row AR, emulated 1 gbit); "
           ">= 90% of the ideal saving (SP cases); host overhead <= 15 us per chunk")


CHUNKS_ALLOWED = "an integer >= 1 (a fixed chunk count; 1 = Megatron's path behind the wrapper) or auto"


def chunk_variant(text: str):
    """A ``--chunks`` word: an int >= 1 or "auto"."""
    word = text.strip().lower()
    if word == "auto":
        return word
    if word.isascii() and word.isdigit() and int(word) >= 1:
        return int(word)
    raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {CHUNKS_ALLOWED}")  # argparse names --chunks


def build_parser() -> argparse.ArgumentParser:
    from coc_inject.bench.attention import CASES as ATTENTION_CASES
    from coc_inject.bench.layers import CASES, DEFAULT_CASES

    parser = argparse.ArgumentParser(prog="coc-inject bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--link", metavar="RATE", help="emulate a link of this rate between the 2 ranks, "
                        "e.g. 1gbit (root only)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=[*CASES, *ATTENTION_CASES],
                        help="linear layer cases, and/or attention: context-parallel core attention, every "
                             "algorithm (coc_inject.bench.attention; writes attention.json / attention.png)")
    parser.add_argument("--chunks", nargs="+", type=chunk_variant, default=[1, 2, 4, 8, "auto"],
                        help="fixed chunk counts and/or auto (COC_PARALLEL_NUM=auto, fresh tune cache; "
                             "default: 1 2 4 8 auto)")
    parser.add_argument("--shape", nargs=3, type=int, default=[4096, 1024, 1024], metavar=("M", "K", "N"),
                        help="per-rank forward matmul [M, K] x [K, N] (M: all rows of the sequence)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--startup-reps", type=int, default=40,
                        help="repetitions of the bootstrap start-up measurement (0: skip)")
    attention = parser.add_argument_group("attention case (--cases attention)")
    attention.add_argument("--cp", nargs="+", type=int, help="context-parallel sizes, one local rank each "
                           "(default: 2 4 on loopback, 2 with --link)")
    attention.add_argument("--seq", type=int, default=2048, help="whole sequence length (default 2048: compute "
                           "and transfers of the same order over the emulated 1 gbit link, one thread per rank)")
    attention.add_argument("--batch", type=int, default=1)
    attention.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    attention.add_argument("--kv-groups", type=int, default=8, help="key/value groups (default 8: no GQA)")
    attention.add_argument("--head-dim", type=int, default=64)
    attention.add_argument("--kernel", default="fused", choices=["fused", "reference", "both"],
                           help="the block kernel (default fused: the device's flash kernel); both: every algorithm "
                                "also on the reference kernel, as extra rows")
    return parser


def run_rank(args, device) -> dict | None:
    """Everything one rank measures; rank 0 returns the results."""
    import torch
    import torch.distributed as dist

    from coc_inject.bench import layers

    dtype = getattr(torch, args.dtype)
    m, k, n = args.shape
    with tempfile.TemporaryDirectory(prefix="coc-bench-tune-") as scratch:  # auto: a fresh cache per run
        results = [layers.measure_case(layers.CASES[name], m=m, k=k, n=n, dtype=dtype, device=device,
                                       chunks=args.chunks, reps=args.reps,
                                       tune_cache=os.path.join(scratch, "tune.json")) for name in args.cases]
    layers.progress("host overhead per chunk (tiny shapes)")
    overhead = layers.host_overhead_per_chunk(device, dtype)
    if dist.get_rank() != 0:
        return None
    sys.stderr.write("\n")
    return {"results": results, "host_overhead": overhead}


def _local_rank(rank, world, port, args, namespaces, work=None, megatron=True):
    """One spawned rank: gloo on the CPU, Megatron's parallel state (initialize_megatron; not
    initialised with ``megatron=False``: work that never touches Megatron skips its import);
    runs ``work(args, device)`` (default run_rank)."""
    from coc_inject.bench import link as link_module

    if namespaces:
        link_module.enter(namespaces[rank], core=rank)
        os.environ["GLOO_SOCKET_IFNAME"] = link_module.INTERFACE
        address = f"{link_module.SUBNET}.1"
    else:
        address = "127.0.0.1"
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    # Megatron allocates its SP buffers with torch.cuda.current_device(); these ranks are CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if megatron:
        initialize_megatron(args, world)
    try:
        return (work or run_rank)(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def initialize_megatron(args, world: int) -> None:
    """Megatron's parallel state: TP = ``args.tp`` (default: the whole world), CP = ``args.cp_size`` (default 1)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=getattr(args, "tp", None) or world,
                                             context_parallel_size=getattr(args, "cp_size", None) or 1)


def run_local(args, work=None, world: int = 2, command: str = "coc-inject bench", megatron: bool = True) -> dict:
    from coc_inject.bench.link import EmulatedLink
    from coc_inject.local_ranks import free_port, run_local_ranks, without_coc_variables

    try:
        with without_coc_variables():  # the bench installs each variant itself
            if args.link:
                with EmulatedLink(args.link) as link:
                    # The rendezvous port is on the link's own address: any port is free there.
                    return run_local_ranks(_local_rank, world, 29500, args, link.names, work, megatron)
            return run_local_ranks(_local_rank, world, free_port(), args, None, work, megatron)
    except RuntimeError as error:
        raise SystemExit(f"{command} failed:\n{error}") from None


def run_torchrun(args, work=None) -> dict | None:
    """Under torchrun: this process is one rank of the job, on its accelerator; Megatron's parallel
    state as initialize_megatron makes it."""
    import torch
    import torch.distributed as dist

    from coc_inject.local_ranks import torchrun_device

    device, backend = torchrun_device("COC_BENCH_DEVICE")
    if device.type == "cpu":  # Megatron allocates its SP buffers with torch.cuda.current_device()
        torch.cuda.current_device = lambda: torch.device("cpu")
    dist.init_process_group(backend)
    initialize_megatron(args, dist.get_world_size())
    try:
        return (work or run_rank)(args, device)
    finally:
        dist.destroy_process_group()


def describe_where(args) -> str:
    if "RANK" in os.environ:
        return f"torchrun, {os.environ.get('WORLD_SIZE')} ranks"
    where = f"emulated {args.link} link (netns + veth + tbf), ranks pinned to cores" if args.link else "plain loopback"
    return f"2 local CPU ranks (gloo), {where}, {args.threads} thread(s)/rank, {platform.node()}"


def main(argv=None) -> int:
    from coc_inject.bench import report
    from coc_inject.bench.attention import CASES as ATTENTION_CASES
    from coc_inject.bench.link import EmulatedLink, LinkError

    args = build_parser().parse_args(argv)
    if args.link and "RANK" not in os.environ:
        try:
            EmulatedLink.check_available()
        except LinkError as error:
            print(f"coc-inject bench: {error}", file=sys.stderr)
            return 2
    if any(case in ATTENTION_CASES for case in args.cases):
        from coc_inject.bench.attention import bench as attention_bench

        code = attention_bench(args)
        args.cases = [case for case in args.cases if case not in ATTENTION_CASES]
        if code or not args.cases:
            return code
    started = time.time()
    measured = run_torchrun(args) if "RANK" in os.environ else run_local(args)
    if measured is None:
        return 0  # not rank 0 of a torchrun job
    summary = report.summarize(measured["results"])
    m, k, n = args.shape
    title = (f"coc-inject bench: {describe_where(args)}; [M,K]x[K,N] = [{m},{k}]x[{k},{n}] {args.dtype}, "
             f"{args.reps} interleaved repetitions")
    print(title)
    print(report.format_table(summary))
    overhead = measured["host_overhead"]
    print(f"host overhead per chunk (tiny shapes): coc-inject pipeline {overhead['pipeline_us']:.1f} us + "
          f"backend collective launch {overhead['collective_launch_us']:.1f} us = {overhead['total_us']:.1f} us")
    startup = None
    if args.startup_reps and "RANK" not in os.environ:
        from coc_inject.bench import startup as startup_module

        wall, cpu = startup_module.measure(sys.executable, args.startup_reps)
        startup = startup_module.summarize(wall, cpu, sys.executable)
        print(f"bootstrap start-up cost (python -c pass, {args.startup_reps} reps): "
              f"off {startup['median_delta_vs_bare_ms']['off']:+.2f} ms, on {startup['median_delta_vs_bare_ms']['on']:+.2f} ms")
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"title": title, "argv": sys.argv, "targets": TARGETS, "seconds": time.time() - started,
               "summary": summary, "host_overhead": overhead, "startup": startup,
               "raw": measured["results"]}
    report.write_json(args.out / "bench.json", payload)
    problem = report.write_png(args.out / "bench.png", summary, measured["results"], title)
    print(f"wrote {args.out / 'bench.json'}" + (f"; {problem}" if problem else f" and {args.out / 'bench.png'}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
