"""``coc-inject lab``: every wing of a model off and on in one process over the emulated group, a row
each (JSON with ``--json``): off and on step times, the speedup, the share of the limit max(C, M)
reached (C: the off step over the link at zero time, the compute-only twin; M: the link's modelled
time of the off step's collectives), the largest loss difference of on against off."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

import torch

from coc_inject.lab import links, shapes, steps, world

ROW_FIELDS = ("model", "part", "on", "preset", "device", "wing", "off_ms", "on_ms", "speedup", "compute_ms", "comm_ms",
              "limit_share", "max_loss_diff", "off_collectives", "on_collectives", "scale_to_depth", "decisions",
              "off_peak_bytes", "on_peak_bytes")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coc-inject lab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"one of {', '.join(shapes.MODELS)} (default tiny)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default cpu)")
    p.add_argument("--preset", default=None, help=f"the interconnect: {', '.join(links.PRESETS)} (default 1gbit on "
                   "the CPU, nvlink4 on a device)")
    p.add_argument("--wing", action="append", choices=(*shapes.WINGS, "all"),
                   help="only these wings (repeatable; default every wing of each part and all of them together)")
    p.add_argument("--part", type=int, action="append", help="only the model's parts of these indices (repeatable)")
    p.add_argument("--steps", type=int, default=3, help="timed steps a variant (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing, where auto's trials run (default 2)")
    p.add_argument("--device-share", type=float, default=None,
                   help="CUDA: share of a transfer's bytes also moved through device memory (default the preset's)")
    p.add_argument("--on", choices=("auto", "fixed"), default="auto",
                   help="on: each wing's auto (default), or fixed: forced on (2 chunks, 2 copies, MoE pieces, the CP ring)")
    p.add_argument("--seq", type=int, default=None,
                   help="every part's sequence set to this (a quick check of a model's code paths on the CPU)")
    p.add_argument("--json", metavar="OUT", help="write the rows to OUT as JSON")
    return p


def _decisions() -> dict:
    from coc_inject import job

    current = job.current()
    if current is None:
        return {}
    return {wing: {str(key): str(value) for key, value in current.decisions(wing).items()}
            for wing in (job.LINEARS, job.ATTENTION, job.MULTI_COPY, job.MOE) if current.decisions(wing)}


def run_part(model: str, part, link, device: str, wings, n_steps: int, warmup: int, fixed: bool = False,
             on_row=None) -> list:
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    chosen = {name: settings for name, settings in steps.variants(part, fixed).items()
              if name == "off" or wings is None or name in wings}
    rows = []
    with world.lab_world(link, device, tp=part.tp, cp=part.cp, ep=part.ep) as state:
        with world.link_as(state, link.zero()):
            twin = steps.run(part, chosen["off"], state, device, dtype, n_steps, warmup)
        off = steps.run(part, chosen["off"], state, device, dtype, n_steps, warmup)
        limit = max(twin["ms"], off["comm_ms"])
        for wing, settings in chosen.items():
            if wing == "off":
                continue
            decided = {}
            on = steps.run(part, settings, state, device, dtype, n_steps, warmup,
                           on_done=lambda: decided.update(_decisions()))
            scale = part.depth / part.layers
            rows.append({
                "model": model, "part": part.name, "on": "fixed" if fixed else "auto", "preset": link.name,
                "device": device, "wing": wing,
                "off_ms": off["ms"], "on_ms": on["ms"], "speedup": off["ms"] / on["ms"],
                "compute_ms": twin["ms"], "comm_ms": off["comm_ms"], "limit_share": limit / on["ms"],
                "max_loss_diff": max(abs(a - b) for a, b in zip(off["losses"], on["losses"])),
                "off_collectives": off["collectives"], "on_collectives": on["collectives"],
                "scale_to_depth": scale, "decisions": decided,
                "off_peak_bytes": off["peak_bytes"], "on_peak_bytes": on["peak_bytes"],
                "losses_off": off["losses"], "losses_on": on["losses"]})
            print(_line(rows[-1]), flush=True)
            if on_row is not None:
                on_row(rows[-1])
    return rows


def _line(row: dict) -> str:
    return (f"{row['part']:<44} {row['wing']:<17} off {row['off_ms']:9.2f} ms  on {row['on_ms']:9.2f} ms  "
            f"{row['speedup']:5.3f}x  of max(C {row['compute_ms']:.2f}, M {row['comm_ms']:.2f}): "
            f"{row['limit_share'] * 100:5.1f}%  loss diff {row['max_loss_diff']:.2e}  collectives "
            f"{row['off_collectives']} -> {row['on_collectives']}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        parts = shapes.model(args.model)
        link = links.preset(args.preset or ("1gbit" if args.device == "cpu" else "nvlink4"))
    except ValueError as error:
        print(f"coc-inject lab: {error}", file=sys.stderr)
        return 2
    if args.seq is not None:
        parts = tuple(replace(part, seq=args.seq) for part in parts)
    if args.device == "cuda":  # torch.cuda.set_device needs an index
        args.device = f"cuda:{torch.cuda.current_device()}"
    if args.device_share is not None:
        link = replace(link, device_share=args.device_share)
    indices = args.part or range(len(parts))
    for index in indices:
        if not 0 <= index < len(parts):
            print(f"--part {index}: the model {args.model} has parts 0..{len(parts) - 1}", file=sys.stderr)
            return 2
    print(f"coc-inject lab: {args.model} on {args.device}, link {link.name} ({link.busbw_gbps:g} GB/s bus bandwidth, "
          f"{link.latency_us:g} us a step) - lab figures on one device with an emulated interconnect, not a cluster run")
    rows = []

    def keep(row):  # written after every row: a step cut short by its time limit keeps what it measured
        rows.append(row)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"model": args.model, "device": args.device, "link": vars(link), "rows": rows}, out, indent=1,
                          default=str)
    for index in indices:
        run_part(args.model, parts[index], link, args.device, args.wing, args.steps, args.warmup, args.on == "fixed",
                 on_row=keep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
