"""COC_MEASURE's cost and accuracy on the whole GPT step (issue 36): the tiny GPT training script over the
emulated link (one core per rank), every variant with and without the meter, interleaved over ROUNDS in a
rotating order, and the script's compute-only twin (examples/compute_only.py) in every round:

    off, off + COC_MEASURE=1, COC_PARALLEL_NUM=auto, auto + COC_MEASURE=1, compute-only twin

Figures (medians of the steps after the warm-up, per round, then the median over rounds):
  * the meter's cost: each variant's step with the meter against without (target: <= 2% slower);
  * the meter's exposed communication of Megatron's unpatched step (off + COC_MEASURE=1, rank 0), plus its
    wait for slower ranks, against the step's communication as the twin shows it, off - C (target: within 10%);
  * each measured variant's hidden share per wing.

    .venv/bin/python benchmarks/measure_cost.py [--rounds 3] [--steps 10] [--link-rate 1gbit] [--moe]

``--moe`` runs the demo's MoE model (EP 2) with COC_MOE_OVERLAP=auto instead of the linears' auto.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from demo import LINK_MODEL  # noqa: E402
from demo_exposure import per_step, twin  # noqa: E402
from demo_moe import MOE_MODEL  # noqa: E402
from demo_runs import run, steady  # noqa: E402
from launch import SITE, clean_env  # noqa: E402

MEASURE_TARGET = 1.02  # the step with the meter at most 2% slower
AGREEMENT = 0.10  # the meter's exposed time of the off step within 10% of off - C


def variants(moe: bool) -> dict:
    wing = {"COC_MOE_OVERLAP": "auto"} if moe else {"COC_PARALLEL_NUM": "auto"}
    name = "COC_MOE_OVERLAP=auto" if moe else "COC_PARALLEL_NUM=auto"
    return {"off": {}, "off + COC_MEASURE=1": {"COC_MEASURE": "1"}, name: wing,
            f"{name} + COC_MEASURE=1": {**wing, "COC_MEASURE": "1"}}


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--moe", action="store_true")
    args = parser.parse_args(argv)
    model = MOE_MODEL if args.moe else LINK_MODEL
    runs = variants(args.moe)
    EmulatedLink.check_available()
    times, figures, twins = {name: [] for name in runs}, {name: [] for name in runs}, []
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        for round_ in range(args.rounds):
            names = list(runs) + ["twin"]
            names = names[round_ % len(names):] + names[:round_ % len(names)]  # a rotating order
            for name in names:
                if name == "twin":
                    twins.append(steady(twin(workdir, link, args.steps, model, f"twin-{round_}")))
                    continue
                tag = f"{list(runs).index(name)}-{round_}"
                extra = runs[name]
                env = clean_env() if not extra else clean_env(
                    PYTHONPATH=str(SITE), COC_TUNE_CACHE=str(Path(workdir) / f"tune-{tag}.json"),
                    COC_REPORT=str(Path(workdir) / f"report-{tag}-{{rank}}.json"), **extra)
                result = run(f"{name}, round {round_ + 1}", env, workdir, args.steps, link, model, name=f"run-{tag}")
                times[name].append(steady(result))
                if "COC_MEASURE" in extra:
                    figures[name].append(per_step(Path(workdir) / f"report-{tag}-0.json", args.steps))
    print(f"\n### COC_MEASURE on the GPT step over the emulated {args.link_rate} link, {args.rounds} rounds "
          f"({'MoE EP 2' if args.moe else 'TP 2 SP'}; medians of steps after the warm-up)")
    ok = True
    plain = [name for name in runs if "COC_MEASURE" not in runs[name]]
    for name in plain:
        measured = f"{name} + COC_MEASURE=1"
        per_round = [m / p for p, m in zip(times[name], times[measured])]
        ratio = statistics.median(per_round)
        ok &= ratio <= MEASURE_TARGET
        print(f"{name:<28} {1e3 * statistics.median(times[name]):8.1f} ms, measured {1e3 * statistics.median(times[measured]):8.1f}"
              f" ms: {ratio:.3f}x (per round {', '.join(f'{r:.3f}' for r in per_round)}; target <= {MEASURE_TARGET})")
    c = statistics.median(twins)
    off, meter = statistics.median(times["off"]), statistics.median(f["exposed"] for f in figures["off + COC_MEASURE=1"])
    # off - C holds every wait, the wait for slower ranks (which the meter books apart) too
    peers = statistics.median(f["peers"] for f in figures["off + COC_MEASURE=1"])
    agreement = (meter + peers) / (1e3 * (off - c))
    ok &= abs(agreement - 1) <= AGREEMENT
    print(f"compute-only twin C {1e3 * c:.1f} ms (rounds {', '.join(f'{1e3 * t:.1f}' for t in twins)}); off - C "
          f"{1e3 * (off - c):.1f} ms; the meter's exposed communication of off {meter:.1f} ms + {peers:.1f} ms waiting "
          f"for slower ranks: {agreement:.3f} of off - C "
          f"(target within {AGREEMENT:.0%})")
    for name, fs in figures.items():
        if not fs:
            continue
        wings = sorted({w for f in fs for w in f["wings"]})
        parts = []
        for wing in wings:
            exposed = statistics.median(f["wings"].get(wing, (0.0, 0.0))[0] for f in fs)
            issued = statistics.median(f["wings"].get(wing, (0.0, 0.0))[1] for f in fs)
            parts.append(f"{wing} {exposed:.1f} of {issued:.1f} ms ({100 * (1 - exposed / issued) if issued else 0:.0f}% hidden)")
        print(f"{name:<36} exposed {statistics.median(f['exposed'] for f in fs):.1f} of "
              f"{statistics.median(f['issued'] for f in fs):.1f} ms per step: " + "; ".join(parts))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
