"""oryx-experiment: train, evaluate and tabulate one experiment of recipes/experiment/.

    oryx-experiment e1_retrieval                      # the documented size (docs/results.md)
    oryx-experiment e2_lm --seeds 1 2 3 train.train_iters=600
    oryx-experiment a2_sequence_mixing --smoke        # seconds: the configuration `make test` runs
    oryx-experiment e1_retrieval_8pairs               # each family at its lr of best validation loss

What an experiment is, how runs are shared and how baselines are made fair: ``oryx_megatron.experiments``.
"""

import logging
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.errors import InputError, command_parser, run_command
from oryx_megatron.experiments.config import load_experiment
from oryx_megatron.experiments.driver import run_experiment
from oryx_megatron.experiments.tables import markdown_table


def _main(argv: List[str]) -> int:
    parser = command_parser("oryx-experiment", __doc__)
    parser.add_argument("experiment", help="a name of recipes/experiment/ (e.g. e1_retrieval)")
    parser.add_argument("overrides", nargs="*", help="oryx-train overrides for every run (key=value)")
    parser.add_argument("--out", default="runs/experiments", help="output root (default runs/experiments)")
    parser.add_argument("--seeds", type=int, nargs="+", help="replace the experiment's seeds")
    parser.add_argument("--smoke", action="store_true", help="the seconds-long configuration (tests)")
    args = parser.parse_intermixed_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        raise InputError(f"override {bad[0]!r} is not key=value")
    exp = load_experiment(args.experiment, args.smoke, args.seeds)
    results = run_experiment(exp, Path(args.out), args.overrides)
    print(markdown_table(results["summary"], exp.metrics))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-experiment", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
