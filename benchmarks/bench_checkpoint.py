"""Checkpoint saves of a 130M model on the CPU: what a save blocks the training loop, synchronous against
asynchronous (``checkpoint.async_save``), and what the checksums cost (docs/reliability.md, "Checksums").

    .venv/bin/python benchmarks/bench_checkpoint.py                       # oryx_tg_130m, 3 saves each way
    .venv/bin/python benchmarks/bench_checkpoint.py --model tiny_oryx_tg --iters 4

Each way trains ``--iters`` iterations of synthetic MQAR (micro batch 1, ``--seq`` tokens) with the distributed
optimizer and saves after every one; rows are the medians over the saves after the first (the first starts
megatron's writer machinery). ``blocking_s``: the save call in the loop; async adds ``background_s`` (the forked
writer's shards and their hashing) and ``finalize_s`` (completing it: metadata, checksums file, `latest`).
``hash_s``: sha256 of every file of the last checkpoint, re-read from disk (what a load's verification costs),
and its fraction of the synchronous save.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Dict, List

from oryx_megatron.checkpoint import file_sha256, latest_name
from oryx_megatron.experiments.runs import compose_run
from oryx_megatron.training.loop import pretrain


def train_and_save(model: str, iters: int, seq: int, async_save: bool, root: Path) -> Dict[str, float]:
    run = compose_run(model, 1, [
        "data=mqar", f"data.seq_length={seq}", f"model.max_sequence_length={seq}",
        "train.micro_batch_size=1", "train.global_batch_size=1", f"train.train_iters={iters}",
        "train.log_interval=1", "optimizer.use_distributed_optimizer=true", "logging.wandb_mode=disabled",
        "checkpoint.save_interval=1", "checkpoint.save_at_end=false", "checkpoint.load=false",
        f"checkpoint.async_save={str(async_save).lower()}", f"checkpoint.dir={root / 'ckpt'}"])
    assert pretrain(run, str(root / "out")) == 0
    rows = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    metrics = {}
    for key in ("checkpoint/blocking_s", "checkpoint/background_s", "checkpoint/finalize_s"):
        seen = [row[key] for row in rows if key in row][1:]  # after the first save
        if seen:
            metrics[key.split("/")[1]] = statistics.median(seen)
    last = latest_name(str(root / "ckpt"))
    files = [f for f in last.iterdir() if f.is_file()]
    start = time.perf_counter()
    for f in files:
        file_sha256(f)
    metrics["hash_s"] = time.perf_counter() - start
    metrics["checkpoint_gb"] = sum(f.stat().st_size for f in files) / 1e9
    return metrics


def table(results: Dict[str, Dict[str, float]]) -> List[str]:
    sync = results["sync"]["blocking_s"]
    lines = ["| save | checkpoint (GB) | blocking (s) | background (s) | finalize (s) | hash (s) | hash / sync save |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for way, m in results.items():
        cells = [f"{m[k]:.2f}" if k in m else "-" for k in ("blocking_s", "background_s", "finalize_s", "hash_s")]
        lines.append(f"| {way} | {m['checkpoint_gb']:.2f} | " + " | ".join(cells) + f" | {m['hash_s'] / sync:.2f} |")
    lines.append(f"\nasync / sync blocking: {results['async']['blocking_s'] / sync:.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="oryx_tg_130m")
    parser.add_argument("--iters", type=int, default=4, help="iterations, each followed by a save")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    results = {}
    for way in ("sync", "async"):
        with tempfile.TemporaryDirectory() as tmp:
            results[way] = train_and_save(args.model, args.iters, args.seq, way == "async", Path(tmp))
    print(f"{args.model}, {args.iters} saves each way (medians after the first), micro batch 1 x {args.seq} tokens")
    print("\n".join(table(results)))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "iters": args.iters, "seq": args.seq,
                                               "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
