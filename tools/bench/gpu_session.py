"""One GPU session, one command: what a fresh H100/H200 measures in 8 minutes, compiles included.

    python3 tools/bench/gpu_session.py --out $OUT          # bare GPU machine, after docs/gpu.md's set-up line
    .venv/bin/python tools/bench/gpu_session.py --toy --out /tmp/s   # CPU rehearsal at toy sizes (make test runs it)

Stages, in order of value, each a process of its own under a time limit (its cap, or what is left of
the session's deadline; at the limit SIGTERM, then SIGKILL after GRACE_S seconds, as `timeout -k`: the
training loop catches SIGTERM to save for requeue and would run on):

  parity      the GPU check's kernel and model sections: every CUDA kernel vs the torch op, the models'
              logits with the CUDA kernels vs the torch ones, cached decode vs the parallel forward
  train_step  the training step at 130M: Transformer, attention-only Oryx, Oryx-TM and Oryx-TG at
              p_attention 0.5 and 0.1, Mamba-2, GDN (docs/performance.md)
  inference   prefill and decode of Oryx-TG 130M at contexts 1k and 16k, batches 1 and 64, per schedule,
              and speculative decoding (docs/inference.md)
  training    the GPU check's training section: megatron's bf16 optimizer path, loss falling, exact resume
  train_reset the training step at 130M on packed documents read each alone (data.reset_at_eod), beside
              the same rows across documents: the varlen kernels' cost
  train_1_4b  the training step at 1.4B with and without selective recomputation, if time is left

What comes back lies in --out, flat, three files, rewritten after every stage (each benchmark also
rewrites its own JSON after every row, so a stage cut short keeps its finished rows):

  results.json  the session header (date, device, versions, commit) and per stage: command, exit code,
                seconds, limit, and the stage's own JSON
  session.log   one line per stage start and end
  logs.tar.gz   every stage's console output and the GPU check's report.md files

Training runs and checkpoints live in --work (default: a temporary folder), never in --out.
"""

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = {"full": 480, "toy": 1200}  # the whole session; the toy rehearsal runs on a loaded CPU
GRACE_S = 10  # between SIGTERM and SIGKILL
MIN_STAGE_S = 30  # a stage with less time left is not started
OUT_FILES = ("results.json", "session.log", "logs.tar.gz")


@dataclass(frozen=True)
class Stage:
    name: str
    cap_s: int  # its own time limit (the deadline may leave it less)
    argv: Tuple[str, ...]  # after the python interpreter; {work} is filled in
    result: str  # the JSON file it writes, under --work


def stages(toy: bool) -> List[Stage]:
    check = ("-m", "oryx_megatron.tools.gpu_check") + (("--toy",) if toy else ())
    train_step = ("tools/bench/bench_train_step.py",)
    inference = ("tools/bench/bench_inference.py",)
    if toy:  # every stage and code path, at the smallest sizes (seconds each, most of it imports)
        step_sizes = ("--model-size", "tiny", "--layers", "1", "--seq", "64", "--micro-batch", "1", "--warmup", "1",
                      "--repeats", "1")
        infer_sizes = ("--contexts", "32", "--batches", "1", "--new-tokens", "2", "--repeats", "1")
        big_sizes = step_sizes
        families = ("oryx_tg",)
    else:
        step_sizes = ("--model-size", "130m", "--seq", "2048", "--micro-batch", "8", "--warmup", "2", "--repeats", "3")
        infer_sizes = ("--model", "oryx_tg_130m", "--contexts", "1024", "16384", "--batches", "1", "64",
                       "--new-tokens", "32", "--repeats", "1")
        big_sizes = ("--model-size", "1_4b", "--seq", "2048", "--micro-batch", "2", "--warmup", "1", "--repeats", "2")
        families = ("oryx_tg", "oryx_tm", "transformer")
    return [
        Stage("parity", 150, check + ("--sections", "kernels", "model", "--out", "{work}/parity"),
              "parity/report.json"),
        Stage("train_step", 120, train_step + step_sizes + ("--p-attention", "0.5", "0.1", "--json",
                                                            "{work}/train_step.json"), "train_step.json"),
        Stage("inference", 100, inference + infer_sizes + ("--speculative", "4", "--json", "{work}/inference.json"),
              "inference.json"),
        Stage("training", 80, check + ("--sections", "training", "performance", "--families", *families,
                                       "--out", "{work}/training"), "training/report.json"),
        Stage("train_reset", 60, train_step + step_sizes + ("--families", "oryx_tg", "oryx_tm", "--p-attention", "0.5",
                                                            "--reset-at-eod", "--json", "{work}/train_reset.json"),
              "train_reset.json"),
        Stage("train_1_4b", 600, train_step + big_sizes + (
            "--families", "oryx_tg", "oryx_tm", "--p-attention", "0.5", "--recompute", "none", "selective",
            "--json", "{work}/train_1_4b.json"), "train_1_4b.json"),
    ]


def run_stage(argv: List[str], log: Path, limit_s: float, env: dict) -> Tuple[int, float]:
    """Run argv with its output in ``log``; at ``limit_s`` SIGTERM its process group, SIGKILL after
    GRACE_S. Returns (exit code: 124 when stopped at the limit, as `timeout`; seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = 124
    return code, round(time.perf_counter() - start, 1)


def header(toy: bool) -> dict:
    import torch

    from oryx_megatron.tools.gpu_check import VERSIONS, package_version, source_version
    from oryx_megatron.training.metrics import git_commit

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (rehearsal)",
        "toy": toy,
        "python": sys.version.split()[0],
        "git_commit": source_version(git_commit()),
        "versions": {name: torch.__version__ if name == "torch" else package_version(*where)
                     for name, where in VERSIONS.items()},
    }


def write_outputs(out: Path, work: Path, results: dict) -> None:
    """results.json and logs.tar.gz in ``out``, replaced whole (a reader never sees half a file)."""
    from oryx_megatron.eval.reporting import write_json

    write_json(out / "results.json", results)
    tmp = out / "logs.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for path in sorted(work.glob("*.log")) + sorted(work.glob("*/report.md")):
            tar.add(path, arcname=str(path.relative_to(work)))
    tmp.replace(out / "logs.tar.gz")


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written (yet), or cut off
        return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="what comes back: the files of OUT_FILES")
    parser.add_argument("--work", type=Path, help="training runs, checkpoints, stage outputs (default: a temp dir)")
    parser.add_argument("--toy", action="store_true", help="toy sizes: the CPU rehearsal")
    parser.add_argument("--deadline", type=float, help="seconds for the whole session (default 480; toy 1200)")
    parser.add_argument("--only", nargs="+", help="run these stages only")
    args = parser.parse_args(argv)
    deadline = time.perf_counter() + (args.deadline or DEADLINE_S["toy" if args.toy else "full"])
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_session_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if not args.toy:
        env["TORCHDYNAMO_DISABLE"] = "0"  # FlexAttention skips blocks only compiled (the Makefile exports 1)
    results = {"header": header(args.toy), "stages": {}}
    log = args.out / "session.log"
    log.write_text("")
    for stage in stages(args.toy):
        if args.only and stage.name not in args.only:
            continue
        left = deadline - time.perf_counter()
        entry = results["stages"][stage.name] = {"command": None, "exit": None, "seconds": None, "results": None}
        if left < MIN_STAGE_S:
            entry["exit"] = "not started: the session's deadline is near"
            _log(log, f"{stage.name}: not started ({left:.0f} s left)")
            continue
        limit = left - GRACE_S if args.toy else min(stage.cap_s, left - GRACE_S)  # toy: CPU speed is no measure
        command = [sys.executable, *(a.format(work=work) for a in stage.argv)]
        entry.update(command=" ".join(command), limit=round(limit))
        _log(log, f"{stage.name}: start, limit {limit:.0f} s")
        entry["exit"], entry["seconds"] = run_stage(command, work / f"{stage.name}.log", limit, env)
        entry["results"] = read_json(work / stage.result)
        _log(log, f"{stage.name}: exit {entry['exit']} after {entry['seconds']} s")
        write_outputs(args.out, work, results)
    write_outputs(args.out, work, results)
    print(log.read_text(), end="")
    return 0 if all(e["exit"] == 0 for e in results["stages"].values()) else 1


def _log(path: Path, line: str) -> None:
    with open(path, "a") as f:
        f.write(f"{datetime.datetime.now().strftime('%H:%M:%S')} {line}\n")
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
