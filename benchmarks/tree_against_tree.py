"""The same coc-inject setting from two source trees, old beside new, on the GPT step over the emulated link:
the demo's link model (TP 2 SP, hidden 512, micro-batch 16, seq 256) at ``--ffn-hidden-size``, off and the
setting from each tree interleaved over ROUNDS. The old tree is any checkout (``git worktree add /tmp/old REV``);
the runs reach it through its own ``sitecustomize`` on PYTHONPATH, the user's way.

    .venv/bin/python benchmarks/tree_against_tree.py --old /tmp/old --env COC_MULTI_COPY=2 COC_PARALLEL_NUM=4 \
        [--rounds 2] [--ffn-hidden-size 2048] [--link-rate 1gbit]
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from demo import LINK_MODEL, LINK_STEPS  # noqa: E402
from demo_runs import variant_runs  # noqa: E402


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path, help="the old tree's root (holds sitecustomize/)")
    parser.add_argument("--env", nargs="+", required=True, metavar="NAME=VALUE", help="the setting both trees run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=2048)
    parser.add_argument("--link-rate", default="1gbit")
    args = parser.parse_args(argv)
    site = args.old.resolve() / "sitecustomize"
    if not (site / "sitecustomize.py").is_file():
        parser.error(f"--old {args.old}: no sitecustomize/sitecustomize.py there")
    setting = dict(item.split("=", 1) for item in args.env)
    label = " ".join(args.env)
    variants = {"off": {}, f"old {label}": dict(setting, PYTHONPATH=str(site)), f"new {label}": setting}
    model = list(LINK_MODEL)
    model[model.index("--ffn-hidden-size") + 1] = str(args.ffn_hidden_size)
    EmulatedLink.check_available()
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        ok, medians = variant_runs(f"old beside new, FFN {args.ffn_hidden_size}, over the emulated {args.link_rate} link",
                                   workdir, link, LINK_STEPS, model, args.rounds, variants, {}, {})
    print(f"new / old: {medians[f'old {label}'] / medians[f'new {label}']:.3f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
