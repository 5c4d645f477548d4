"""oryx-eval: evaluate a checkpoint under the inference mode schedules.

    oryx-eval runs/ckpt --task ppl          # held-out perplexity per schedule
    oryx-eval runs/ckpt --task mode_switch  # per-position loss around a mixer switch (+ CSV, PNG)
    oryx-eval runs/ckpt --task mqar         # retrieval accuracy: attention / linear / mixed
    oryx-eval runs/ckpt --task mqar --query-spans 3   # the queries in 3 spans at random positions
    oryx-eval runs/ckpt --task niah
    oryx-eval runs/ckpt --task mqar --router "threshold=0.5"            # + the row 'router threshold=0.5'
    oryx-eval runs/ckpt --task ppl --router "budget=0.1 chunk_size=16"  # + the row 'router budget=0.1 ...'
    torchrun --nproc-per-node 4 -m oryx_megatron.cli.evaluate runs/ckpt --task niah --context-parallel 4

Each task prints a table and writes <out>/<task>.json (see docs/inference.md). ``--router SPEC`` adds the
model's router under ``router SPEC``: ``router threshold=P`` (``--router threshold=0.5``) or
``router budget=B [chunk_size=N]`` (``--router "budget=0.1 chunk_size=16"``); docs/routing.md. Every task is
parallel forwards (teacher-forced): ``--context-parallel N`` splits every sequence over N processes (long
contexts; docs/training.md, "Context parallelism").
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.common import add_model_arguments, load_checkpoint
from oryx_megatron.cli.errors import InputError, command_parser, one_line, run_command
from oryx_megatron.data.schedules import parse_schedule
from oryx_megatron.eval.mode_switch import evaluate_mode_switch
from oryx_megatron.eval.ppl import evaluate_ppl
from oryx_megatron.eval.retrieval import evaluate_retrieval

TASKS = ("ppl", "mode_switch", "mqar", "niah")


def format_table(rows: List[dict]) -> str:
    """Rows of equal keys as aligned columns; floats with 4 decimals, None as '-'."""
    def cell(value):
        return "-" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)

    columns = list(rows[0])
    cells = [columns] + [[cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(line, widths)).rstrip() for line in cells)


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("oryx-eval", __doc__)
    add_model_arguments(parser)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--router", metavar="SPEC", help="also evaluate the model's router (a row, or a curve of "
                        "mode_switch) under the router schedule 'router threshold=P' (e.g. --router 'threshold=0.5') "
                        "or 'router budget=B [chunk_size=N]' (e.g. --router 'budget=0.1'; docs/routing.md)")
    parser.add_argument("--out", default="eval", help="output directory (default ./eval)")
    parser.add_argument("--context-parallel", type=int, default=1, metavar="N",
                        help="split every sequence over N processes (launch N with torchrun)")
    parser.add_argument("--wandb", choices=("disabled", "offline", "online"), default="disabled",
                        help="also log the result to W&B (project oryx-megatron, job type eval)")
    held_out = parser.add_argument_group("ppl and mode_switch (held-out windows of the checkpoint's dataset)")
    held_out.add_argument("--num-batches", type=int, default=8)
    held_out.add_argument("--batch-size", type=int, default=4, help="windows (or retrieval samples) per forward")
    held_out.add_argument("--attention-last", type=int, help="ppl: attention tail of linear_then_attention "
                                                             "(default seq_length // 8)")
    held_out.add_argument("--switch-at", type=int, help="mode_switch: switch position (default seq_length // 2)")
    held_out.add_argument("--smooth", type=int, default=16, help="mode_switch: trailing-mean width for convergence")
    held_out.add_argument("--tolerance", type=float, default=0.1,
                          help="mode_switch: convergence band, a fraction of the gap between the modes")
    held_out.add_argument("--answers-only", action="store_true",
                          help="mode_switch: score only the positions of the loss mask (MQAR: the answers)")
    retrieval = parser.add_argument_group("mqar and niah")
    retrieval.add_argument("--num-samples", type=int, default=64)
    retrieval.add_argument("--seq-len", type=int, help="sample length (default the checkpoint's data.seq_length)")
    retrieval.add_argument("--seed", type=int, default=0)
    retrieval.add_argument("--num-pairs", type=int, help="mqar: key-value pairs (default the checkpoint's "
                                                          "data.mqar_num_pairs, 8)")
    retrieval.add_argument("--num-queries", type=int, help="mqar: pairs asked (default all, or the "
                                                            "checkpoint's data.mqar_num_queries)")
    retrieval.add_argument("--query-spans", type=int, help="mqar: 0 asks the queries last (today's MQAR); S "
                           "scatters them in S spans at random positions between the context segments and the filler "
                           "(default the checkpoint's data.mqar_query_spans, else 0)")
    retrieval.add_argument("--context-segments", type=int, help="mqar, scattered: segments of the pairs (default "
                                                                 "the checkpoint's, else --query-spans)")
    retrieval.add_argument("--num-needles", type=int, default=1, help="niah: needles (> 1: multi-key)")
    retrieval.add_argument("--key-len", type=int, default=2, help="niah: tokens per key")
    retrieval.add_argument("--value-len", type=int, default=4, help="niah: tokens per value (the answer)")
    retrieval.add_argument("--haystack", choices=("heldout", "random"), default="heldout",
                           help="niah: held-out data tokens (random ids when unavailable) or random ids")
    return parser


def run_task(model, run, args: argparse.Namespace, out: Path) -> dict:
    router = parse_schedule(f"router {args.router}") if args.router else None
    if args.task == "ppl":
        return evaluate_ppl(model, run, args.num_batches, args.batch_size, args.attention_last, router)
    if args.task == "mode_switch":
        return evaluate_mode_switch(model, run, out, args.switch_at, args.num_batches, args.batch_size, args.smooth,
                                    args.tolerance, args.answers_only, router)
    return evaluate_retrieval(model, run, args.task, args.num_samples, args.seq_len, args.batch_size, args.seed,
                              args.haystack, args.num_pairs, args.num_queries, args.num_needles, args.key_len,
                              args.value_len, router, args.query_spans, args.context_segments)


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_batches", "batch_size", "num_samples", "smooth"):
        if getattr(args, name) < 1:
            raise InputError(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.router:
        try:
            parse_schedule(f"router {args.router}")
        except ValueError as e:
            raise InputError(f"argument --router: {e}") from e
    _check_context_parallel(args)
    model, run = load_checkpoint(args)
    if int(os.environ.get("RANK", 0)) != 0:  # context parallel: rank 0 reports
        run_task(model, run, args, Path(args.out))
        return 0
    out = Path(args.out)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = run_task(model, run, args, out)
    except (OSError, ValueError) as e:
        if created:  # a failed task leaves no empty --out behind
            shutil.rmtree(out, ignore_errors=True)
        raise InputError(f"--task {args.task}: {one_line(e)}") from e
    result["checkpoint"] = args.checkpoint
    (out / f"{args.task}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result["rows"]))
    print(f"wrote {out / f'{args.task}.json'}")
    if args.wandb != "disabled":
        log_to_wandb(result, args, out)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-eval", _main, argv)


def _check_context_parallel(args: argparse.Namespace) -> None:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.context_parallel < 1 or args.context_parallel != world:
        raise InputError(f"argument --context-parallel: {args.context_parallel} must be >= 1 and the number of "
                         f"processes launched ({world}: torchrun --nproc-per-node {args.context_parallel})")
    if args.context_parallel > 1 and args.router:
        raise InputError("argument --context-parallel: the router's rows (--router) are evaluated in one process")


def log_to_wandb(result: dict, args: argparse.Namespace, out: Path) -> None:
    """The result's rows as a W&B table and flat metrics; a W&B failure is only reported."""
    try:
        import wandb

        run = wandb.init(mode=args.wandb, project="oryx-megatron", job_type="eval", dir=str(out),
                         config={"task": args.task, "checkpoint": args.checkpoint})
        rows = result["rows"]
        run.log({f"{args.task}/table": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])})
        label = next(iter(rows[0]))  # the first column names the row (schedule or switch)
        run.log({f"{args.task}/{row[label]}/{key}": value for row in rows for key, value in row.items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool)})
        run.finish()
    except Exception as e:  # the result is on disk already
        print(f"W&B logging failed: {e!r}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
