"""One GPU session, one command: what a fresh H100/H200 measures in 8 minutes, compiles included.

    python3 -m oryx_megatron.checks.session --out $OUT              # bare GPU machine (docs/gpu.md: the call)
    python3 -m oryx_megatron.checks.session --out $OUT --only inference train_reset --deadline 150   # a rerun
    .venv/bin/python -m oryx_megatron.checks.session --toy --out /tmp/s   # CPU rehearsal (make test runs it)

First the kernel probes (``probes``): every CUDA kernel once, each in a process of its own under a time
limit; the verdicts go to every later stage through ``$ORYX_KERNEL_PROBES``. Then the stages of
``plan.stages`` in order of value, each a process of its own under its time limit (``plan.limit``: the
caps, the probes' included, add up to at most the deadline; SIGTERM at the limit, SIGKILL GRACE_S later).
Each stage rewrites its JSON after every row and the session folds it into results.json while the stage
runs, so a stage, or the whole call, cut at any moment keeps what it finished. The Triton and inductor
caches (autotuning included) live in the work folder and are shared by every process of the session.

What comes back lies in --out, flat (``outputs``): results.json, session.log, logs.tar.gz. Training runs
and checkpoints live in --work, never in --out.
"""

import argparse
import os
import sys
import time
from pathlib import Path
from typing import List, Optional

from oryx_megatron import ops
from oryx_megatron.checks.session import plan
from oryx_megatron.checks.session.outputs import Outputs, header
from oryx_megatron.checks.session.probes import run_probes, refused
from oryx_megatron.checks.session.runner import run_stage
from oryx_megatron.ops import probe as probing

ROOT = Path(__file__).resolve().parents[3]  # the checkout: stages run from here
DEFAULT_WORK = Path("/tmp/oryx_gpu_session")  # kept between calls on a warm machine: a rerun reuses its caches


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m oryx_megatron.checks.session",
                                     description=__doc__.split("\n\n")[0])
    names = [stage.name for stage in plan.stages(toy=False)]
    parser.add_argument("--out", type=Path, required=True, help="what comes back: results.json, session.log, "
                                                                "logs.tar.gz")
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK,
                        help=f"training runs, checkpoints, stage outputs, compile caches (default {DEFAULT_WORK})")
    parser.add_argument("--toy", action="store_true", help="toy sizes: the CPU rehearsal")
    parser.add_argument("--deadline", type=float, help="seconds for the whole session (default: full "
                                                       f"{plan.DEADLINE_S['full']}, toy {plan.DEADLINE_S['toy']})")
    parser.add_argument("--only", nargs="+", choices=names, metavar="STAGE",
                        help=f"run these stages only (after the probes): {', '.join(names)}")
    parser.add_argument("--with-causal-conv1d", action="store_true",
                        help="probe (and then use) causal-conv1d's CUDA kernels, refused unprobed by default")
    parser.add_argument("--rehearse-probe-crash", metavar="OP", choices=ops.cuda_ops(),
                        help="--toy only: this op's probe process dies by SIGSEGV (the rehearsal of a crashing kernel)")
    args = parser.parse_args(argv)
    if args.rehearse_probe_crash and not args.toy:
        parser.error("--rehearse-probe-crash is a rehearsal: only with --toy")
    return args


def stage_env(work: Path, toy: bool) -> dict:
    """The environment of every probe and stage: the checkout on the path, W&B offline, the compile
    caches shared across processes (Triton's autotuning results included), torch.compile on (the GPU)."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "TRITON_CACHE_DIR": str(work / "triton_cache"), "TRITON_CACHE_AUTOTUNING": "1",
           "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache")}
    if not toy:
        env["TORCHDYNAMO_DISABLE"] = "0"  # FlexAttention skips blocks only compiled (the Makefile exports 1)
    return env


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + (args.deadline or plan.DEADLINE_S["toy" if args.toy else "full"])
    selected = [s for s in plan.stages(args.toy) if not args.only or s.name in args.only]
    caps = plan.caps(selected, deadline - start)
    args.work.mkdir(parents=True, exist_ok=True)
    env = stage_env(args.work, args.toy)
    results = {"header": header(args.toy), "stages": {s.name: {"exit": None, "results": None} for s in selected},
               "plan": {"deadline_s": round(deadline - start), "caps_s": caps, "grace_s": plan.GRACE_S,
                        "env": {k: env[k] for k in env if k.startswith(("TRITON", "TORCHINDUCTOR", "TORCHDYNAMO"))}},
               "probes": None}
    out = Outputs(args.out, args.work, results)

    limit = plan.limit(plan.PROBES, deadline - time.perf_counter(), caps)
    results["probes"] = run_probes(args.work, env, limit, args.with_causal_conv1d, args.rehearse_probe_crash)
    env[probing.PROBES_ENV_VAR] = str(args.work / "kernel_probes.json")
    out.log(f"probes: {len(refused(results['probes']))} of {len(results['probes'])} refused"
            + "".join(f"\n  {line}" for line in refused(results["probes"])))
    out.write_results()

    for stage in selected:
        entry = results["stages"][stage.name]
        limit = plan.limit(stage.name, deadline - time.perf_counter(), caps)
        if limit < plan.MIN_STAGE_S:
            entry["exit"] = "not started: the session's deadline is near"
            out.log(f"{stage.name}: not started ({limit:.0f} s would be left)")
            continue
        command = [sys.executable, *(a.replace("{work}", str(args.work)) for a in stage.argv)]
        entry.update(command=" ".join(command), limit=round(limit))
        out.log(f"{stage.name}: start, limit {limit:.0f} s")
        entry["exit"], entry["seconds"] = run_stage(
            command, ROOT, args.work / f"{stage.name}.log", limit, plan.GRACE_S, env,
            progress=lambda: out.fold(stage.name, args.work / stage.result))
        out.log(f"{stage.name}: exit {entry['exit']} after {entry['seconds']} s")
        out.write_results()
        out.write_logs()
    out.write_results()
    out.write_logs()
    print((args.out / "session.log").read_text(), end="")
    return 0 if all(e["exit"] == 0 for e in results["stages"].values()) else 1
