"""oryx-chaos-train: kill a training run again and again and prove it ends where an uninterrupted run ends.

1. **Reference**: ``python -m oryx_megatron.cli.train <overrides>`` to ``train_iters`` in one go, with the same
   ``checkpoint.save_interval`` (saving does not change the numbers, but the runs then differ in nothing
   but the kills).
2. **Chaos**: the same command with a fixed ``checkpoint.dir``, started again after every kill until it
   reaches ``train_iters``. The kill plan is drawn from ``--seed``: ``--kills`` target iterations, uniform
   over ``[1, train_iters - 1]`` and sorted, each with a signal and an aim:

   * ``step`` kills (SIGKILL or, with probability ``--sigterm-fraction``, SIGTERM) fire once the attempt
     has logged the target iteration, after a random delay within one step (so they land anywhere in
     forward, backward, optimizer step, logging);
   * ``save`` kills (SIGKILL: a node dying mid-save) wait for the first save at or after the target: the
     driver polls ``checkpoint.dir`` every 2 ms for an ``iter_NNNNNNN`` directory newer than ``latest``
     that this attempt created or rewrote (the directory's or its run_config.yaml's mtime), then kills
     after a random delay below half the shortest save of that sort seen so far (a process's first save
     starts megatron's writer Manager and takes seconds, later ones ~0.1 s); if the save finishes first,
     the kill goes at once when the next save starts. SIGKILL goes to the trainer's process group;
   * with ``--async-save`` (``checkpoint.async_save=true``) those kills are ``write`` kills instead, inside an
     async save's background write: armed once the attempt has logged the save's ``checkpoint/blocking_s`` row
     (training goes on) and until `latest` names it, they fire after a random delay below half the shortest
     background write seen (``checkpoint/background_s``), or at once after a miss.

   Where each kill lands is recorded as it is sent: the driver stops the trainer's process group (SIGSTOP),
   looks (``watch.landing``: ``write`` while an async save's writer process is alive, ``save`` while a save
   is in progress with no writer alive, else ``step``; and that save's files with their sizes), then
   signals it (a SIGTERM is followed by SIGCONT). A save or write kill that finds its save outside its aim
   lets the group continue: before its write (no shard file yet) it tries again 2 ms later, past it (the save
   over, or its writers ended) it aims at the next save at once; so it lands where it was aimed: asserted,
   and required for exit code 0. While a kill is pending, an attempt stops by itself (``train.exit_interval``,
   saving) ``2 * save_interval`` iterations past the kill's target, and before ``train_iters`` where that leaves
   the kill a save interval (``attempt_cap``): a driver that reacts late cannot let the run end with kills still
   planned; the next attempt then carries the kill, armed at once. The trainers run at a lower priority
   (``watch.TRAINER_NICE``), so that on a loaded machine the driver, polling every 2 ms, is rarely late at all.
   Whether a kill left an incomplete checkpoint is decided after the process died, from the disk: an iteration
   directory written by this attempt that ``latest`` does not name. SIGTERM is sent only once the attempt has logged an iteration (the
   preemption handler is installed).
3. **Checks** per kill: the next attempt resumes from the checkpoint ``latest`` named when the killed one
   died (its "resumed from ... at iteration R" line) and reaches at least its iteration. Steps redone =
   last iteration logged by the killed attempt - R; allowed: ``save_interval - 1`` (``save_interval`` when
   the kill hit the save of the last step, plus the steps taken after that save's iteration while its
   background write was in flight; 0 after a SIGTERM, which saves, and completes the save in flight, before
   exiting); anything above is counted as *steps lost beyond the save interval* (must be 0); no incomplete
   checkpoint may hold a checksum file (it is written last). At the end: the loss of every iteration (for
   each iteration the LAST row logged: killed attempts log steps that are redone later; a row cut by a
   SIGKILL is skipped) and every tensor of both final checkpoints (model weights and optimizer moments,
   read with torch.distributed.checkpoint) against the reference, plus the scheduler / loader state; and
   the chaos run's final checkpoint against its checksums.

Outputs under ``--out``: ``reference/`` and ``chaos/attempt_NN/`` (Hydra run dirs with metrics.jsonl),
``chaos/ckpt``, ``*.log`` (each process's console), ``chaos.json`` and ``summary.md``. Exit code 0 only when
every kill was survived, no step was lost beyond the save interval, no incomplete checkpoint holds checksums,
the final one matches its own, and losses and tensors match within ``--atol`` (default 0: CPU fp32 runs are
bitwise deterministic).

    oryx-chaos-train --kills 30 --train-iters 120 --save-interval 5 --seed 1 --out runs/chaos   # docs/reliability.md
    oryx-chaos-train --kills 4 -- model.family=oryx_tm                                         # Hydra overrides
    oryx-chaos-train --kills 4 -- optimizer.use_distributed_optimizer=true                     # docs/training.md
    oryx-chaos-train --kills 4 --async-save                                                    # background writes
"""

import argparse
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from oryx_megatron.checks.chaos.compare import compare_checkpoints, loss_curve
from oryx_megatron.checks.chaos.plan import Kill, plan_kills
from oryx_megatron.checks.chaos.watch import (
    Stats,
    latest_iteration,
    reap_group,
    run_attempt,
    start_trainer,
    written_since,
)

# The tiny Oryx-TG of tests/test_train.py (one layer) on synthetic MQAR: no corpus needed.
DEFAULT_OVERRIDES = [
    "model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4", "model.kv_channels=16",
    "model.ffn_hidden_size=128", "model.vocab_size=257", "model.max_sequence_length=64",
    "model.linear_chunk_size=16",
    "data=mqar", "data.seq_length=64", "data.mode_schedule.chunk_size=16",
    "train.micro_batch_size=2", "train.global_batch_size=8", "train.eval_interval=null",
    "optimizer.lr_warmup_iters=2", "logging.wandb_mode=disabled",
]
REQUEUE_EXIT_CODE = 3  # oryx_megatron.launch.REQUEUE_EXIT_CODE (not imported: keeps the driver light)
CHECKSUMS = "checksums.sha256"  # oryx_megatron.checkpoint.CHECKSUMS (likewise)
RESUMED = re.compile(r"resumed from (\S+) at iteration (\d+)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="oryx-chaos-train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides of oryx-train (after DEFAULT_OVERRIDES)")
    p.add_argument("--kills", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="seeds the kill plan and the delays")
    p.add_argument("--train-iters", type=int, default=24)
    p.add_argument("--save-interval", type=int, default=4)
    p.add_argument("--sigterm-fraction", type=float, default=0.3)
    p.add_argument("--save-fraction", type=float, default=0.3, help="share of kills aimed inside a save")
    p.add_argument("--async-save", action="store_true",
                   help="checkpoint.async_save=true; the save kills aim inside the background writes")
    p.add_argument("--out", default="runs/chaos")
    p.add_argument("--atol", type=float, default=0.0, help="allowed loss / tensor difference (0: bitwise)")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the training processes")
    p.add_argument("--attempt-timeout", type=float, default=600.0)
    p.add_argument("--concurrent-reference", action="store_true",
                   help="run the reference beside the chaos run instead of before it (faster with 2+ idle cores)")
    p.add_argument("--no-defaults", action="store_true", help="do not prepend DEFAULT_OVERRIDES (tiny model)")
    args = p.parse_args(argv)
    if args.train_iters < 2 or args.save_interval < 1 or args.kills < 0:
        p.error("need --train-iters >= 2, --save-interval >= 1, --kills >= 0")
    return args


def chaos(args: argparse.Namespace) -> dict:
    out = Path(args.out).resolve()
    if (out / "chaos" / "ckpt").exists() or (out / "reference" / "ckpt").exists():
        raise SystemExit(f"{out} holds an earlier chaos run: pick another --out")
    out.mkdir(parents=True, exist_ok=True)
    overrides = ([] if args.no_defaults else DEFAULT_OVERRIDES) + list(args.overrides) + [
        f"train.train_iters={args.train_iters}", f"checkpoint.save_interval={args.save_interval}",
        "checkpoint.save_at_end=true", "checkpoint.load=true", "train.log_interval=1",
        f"checkpoint.async_save={str(args.async_save).lower()}"]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
           "OMP_NUM_THREADS": str(args.threads), "PYTHONUNBUFFERED": "1"}
    base = [sys.executable, "-m", "oryx_megatron.cli.train", *overrides]
    rng, stats, T, S = random.Random(args.seed), Stats(), args.train_iters, args.save_interval
    started = time.monotonic()

    # 1. the uninterrupted reference
    ref_run, ref_ckpt = out / "reference", out / "reference" / "ckpt"
    cmd = base + [f"checkpoint.dir={ref_ckpt}", f"hydra.run.dir={ref_run}", "train.exit_interval=null"]
    print(f"reference: {T} iterations, save_interval {S} -> {ref_run}", flush=True)
    ref_proc = None
    if args.concurrent_reference:  # beside the chaos run (2 processes); its timings then come from the chaos run
        ref_proc = start_trainer(cmd, env, out / "reference.log")
        reference_s = 0.0
    else:
        rc, _, _ = run_attempt(cmd, env, ref_run, ref_ckpt, out / "reference.log", None, rng, stats,
                               args.attempt_timeout)
        _check_reference(rc, ref_ckpt, T, out)
        reference_s = time.monotonic() - started
        print(f"reference done in {reference_s:.1f} s (step {stats.step_time() * 1e3:.0f} ms, "
              f"save {stats.save_time() * 1e3:.0f} ms)", flush=True)

    # 2. the same run under chaos
    plan = plan_kills(args.kills, T, rng, args.sigterm_fraction, args.save_fraction,
                      save_aim="write" if args.async_save else "save")
    ckpt = out / "chaos" / "ckpt"
    (out / "chaos").mkdir(exist_ok=True)
    pending, attempts, failure = list(plan), [], None
    bar = tqdm(total=len(plan), desc="kills", unit="kill", dynamic_ncols=True, file=sys.stdout)
    previous: Optional[Kill] = None
    max_attempts = len(plan) + T + 3  # a capped attempt advances at least one iteration
    for attempt in range(max_attempts):
        run_dir = out / "chaos" / f"attempt_{attempt:02d}"
        log_path = out / "chaos" / f"attempt_{attempt:02d}.log"
        kill = pending[0] if pending else None
        before = latest_iteration(ckpt)
        cap = attempt_cap(kill, before, T, S)
        cmd = base + [f"checkpoint.dir={ckpt}", f"hydra.run.dir={run_dir}",
                      f"train.exit_interval={cap - before if cap is not None else 'null'}"]
        rc, tail, since = run_attempt(cmd, env, run_dir, ckpt, log_path, kill, rng, stats, args.attempt_timeout)
        text = log_path.read_text(errors="replace")
        resumed = RESUMED.search(text)
        first = min((r["iteration"] for r in tail.rows if "train/loss" in r), default=None)
        # the trainer's "resumed from" line; else the first iteration it logged tells
        resumed_from = int(resumed.group(2)) if resumed else (first - 1 if first else 0)
        latest = latest_iteration(ckpt)
        # it stopped by itself at its cap before its kill was sent (the driver reacted late): the next one carries it
        stopped_at_cap = rc == 0 and kill is not None and not kill.sent and cap is not None and latest == cap
        attempts.append({"attempt": attempt, "exit_code": rc, "resumed_from": resumed_from, "first_logged": first,
                         "last_logged": tail.last if tail.last >= 0 else None, "latest_after": latest, "cap": cap,
                         "stopped_at_cap": stopped_at_cap, "leftover_processes": stats.leftovers[-1]})
        if previous is not None:  # did the restart honour the previous kill?
            previous.resumed_from = resumed_from
            if previous.last_logged is not None:
                previous.redone = max(0, previous.last_logged - resumed_from)
                in_flight = (max(0, previous.last_logged - previous.incomplete_iteration)  # steps beside a write
                             if previous.inside_save else 0)
                allowed = (0 if previous.exit_code == REQUEUE_EXIT_CODE
                           else S - 1 + int(previous.inside_save) + in_flight)
                previous.lost_beyond_interval = max(0, previous.redone - allowed)
            # it trained on: to the end, to where the killed one got, or until the next planned kill
            progressed = latest == T or tail.last >= (previous.last_logged or 0) or (
                kill is not None and kill.sent and first is not None)
            previous.survived = (resumed_from == before and (first is None or first == resumed_from + 1)
                                 and progressed and rc in (0, REQUEUE_EXIT_CODE, -signal.SIGKILL))
            if not previous.survived:
                previous.note += f" restart resumed from {resumed_from} (latest was {before}), exit {rc};"
            _report(bar, previous)
            previous = None
        expected = {-signal.SIGKILL} if kill is not None and kill.signal == "SIGKILL" else {REQUEUE_EXIT_CODE}
        if kill is not None and kill.sent and rc in expected | {0}:
            pending.pop(0)
            kill.attempt, kill.exit_code, kill.latest_after = attempt, rc, latest
            kill.last_logged = tail.last if tail.last >= 0 else None
            incomplete = [it for it in written_since(ckpt, since) if it > latest]
            kill.inside_save = bool(incomplete)
            kill.incomplete_iteration = max(incomplete) if incomplete else None
            if incomplete:  # where in the save it died: what the incomplete checkpoint holds
                kill.incomplete_files = sorted(os.listdir(ckpt / f"iter_{max(incomplete):07d}"))
            if rc == 0:
                kill.note += " the run finished before the signal took effect;"
            previous = kill
            if rc == 0 and latest == T:
                kill.survived, kill.redone, kill.lost_beyond_interval = True, 0, 0
                _report(bar, kill)
                previous = None
                break
            continue
        if rc == 0 and latest == T:
            break
        if stopped_at_cap:
            kill.events.append(f"attempt {attempt} stopped at its cap, iteration {cap}, before the kill was sent")
            continue
        failure = (f"attempt {attempt} exited with code {rc} (kill planned: {asdict(kill) if kill else None}); "
                   f"see {log_path}:\n" + "\n".join(text.splitlines()[-15:]))
        break
    else:
        failure = f"the run did not reach iteration {T} after {max_attempts} attempts"
    bar.close()
    chaos_s = time.monotonic() - started - reference_s
    if ref_proc is not None:
        try:
            rc = ref_proc.wait(timeout=args.attempt_timeout)
        except subprocess.TimeoutExpired:
            ref_proc.kill()
            rc = ref_proc.wait()
        reap_group(ref_proc.pid)
        _check_reference(rc, ref_ckpt, T, out)

    # 3. compare with the reference
    runs = sorted((out / "chaos").glob("attempt_*/metrics.jsonl"))
    ref_curve, _ = loss_curve([ref_run / "metrics.jsonl"])
    curve, redone_mismatched = loss_curve(runs)
    iters = sorted(set(ref_curve) | set(curve))
    loss_diffs = [abs(ref_curve[i] - curve[i]) if i in ref_curve and i in curve else math.inf for i in iters]
    final_loss_diff = (abs(ref_curve[T] - curve[T]) if T in ref_curve and T in curve else math.inf)
    weights = (compare_checkpoints(ref_ckpt / f"iter_{T:07d}", ckpt / f"iter_{T:07d}")
               if latest_iteration(ckpt) == T else {"max_weight_diff": math.inf, "max_tensor_diff": math.inf,
                                                    "common_state_diff": math.inf, "checksums_match": False})
    done = [k for k in plan if k.sent and k.attempt >= 0]
    summary = {
        "kills_planned": len(plan),
        "kills_delivered": len(done),
        "kills_survived": sum(k.survived for k in done),
        "kills_inside_saves": sum(k.inside_save for k in done),
        "kills_landed_inside_writes": sum(k.landed == "write" for k in done),
        # save and write kills that did not land inside what they aimed at (watch.landing): must be 0
        "aimed_kills_off_target": sum(k.aim != "step" and k.landed != k.aim for k in done),
        "sigterm": sum(k.signal == "SIGTERM" for k in done),
        "sigkill": sum(k.signal == "SIGKILL" for k in done),
        "restarts": len(attempts) - 1,
        "driver_max_poll_gap_s": round(stats.max_poll_gap_s, 3),  # informational: how late a kill could be
        "attempts_stopped_at_cap": sum(a["stopped_at_cap"] for a in attempts),  # informational: the driver was late
        "steps_redone": sum(k.redone or 0 for k in done),
        "steps_lost_beyond_save_interval": sum(k.lost_beyond_interval or 0 for k in done),
        "iterations_compared": len(iters),
        "final_loss_diff": final_loss_diff,
        "max_loss_diff": max(loss_diffs, default=math.inf),
        "redone_rows_mismatched": redone_mismatched,
        # processes a trainer left behind although it exited by itself (0 or 3): informational
        "leftover_processes_after_clean_exits": sum(a["leftover_processes"] for a in attempts
                                                    if a["exit_code"] in (0, REQUEUE_EXIT_CODE)),
        "max_weight_diff": weights["max_weight_diff"],
        "max_tensor_diff": weights["max_tensor_diff"],
        "common_state_diff": weights["common_state_diff"],
        "final_checksums_match": weights["checksums_match"],
        # a checksum file is written last: a checkpoint cut off by a kill has none
        "incomplete_with_checksums": sum(CHECKSUMS in k.incomplete_files for k in done),
        "reference_s": round(reference_s, 1),
        "chaos_s": round(chaos_s, 1),
    }
    ok = (failure is None and summary["kills_delivered"] == len(plan) and summary["kills_survived"] == len(plan)
          and summary["steps_lost_beyond_save_interval"] == 0 and len(iters) == T and iters == list(range(1, T + 1))
          and all(summary[k] <= args.atol for k in ("max_loss_diff", "max_weight_diff", "max_tensor_diff"))
          and summary["common_state_diff"] == 0 and summary["redone_rows_mismatched"] == 0
          and summary["final_checksums_match"] and summary["incomplete_with_checksums"] == 0
          and summary["aimed_kills_off_target"] == 0)
    summary["ok"] = ok
    result = {"summary": summary, "failure": failure, "args": vars(args), "overrides": overrides,
              "kills": [asdict(k) for k in plan], "attempts": attempts, "checkpoints": weights}
    (out / "chaos.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    table = summary_table(summary, T, S)
    (out / "summary.md").write_text(table + "\n")
    print(table)
    if failure:
        print(f"FAILURE: {failure}", file=sys.stderr)
    print(f"{'OK' if ok else 'MISMATCH'}: {out / 'chaos.json'}", flush=True)
    return result


def attempt_cap(kill: Optional[Kill], before: int, T: int, S: int) -> Optional[int]:
    """The iteration at which an attempt resuming from ``before`` stops by itself while ``kill`` is pending:
    ``2 * S`` past the kill's target (a step kill lands within a step of it, a save kill within the next two
    saves); past ``T``, at ``T - 1`` when that leaves the kill at least ``S`` iterations (a SIGTERM has to land
    before the attempt's last step to be a preemption), else None (no cap: to ``T``), as without a pending kill."""
    if kill is None:
        return None
    cap = max(kill.target, before) + 2 * S
    if cap < T:
        return cap
    return T - 1 if T - 1 - before >= S else None


def _check_reference(rc: int, ref_ckpt: Path, T: int, out: Path) -> None:
    if rc != 0 or latest_iteration(ref_ckpt) != T:
        raise SystemExit(f"the reference run failed (exit code {rc}); see {out / 'reference.log'}")


def _report(bar: tqdm, k: Kill) -> None:
    what = {"write": "background write", "save": "save"}.get(k.landed)
    where = (f"landed inside the {what} of iteration {k.landed_iteration}" if what
             else f"landed in a step after iteration {k.last_logged}")
    left = f", left iteration {k.incomplete_iteration} incomplete" if k.inside_save else ""
    bar.write(f"kill {k.index + 1}: {k.signal} ({k.aim}, target {k.target}) {where}{left}, exit {k.exit_code}; "
              f"latest {k.latest_after} -> resumed from {k.resumed_from}, redone {k.redone}, "
              f"lost beyond interval {k.lost_beyond_interval}: {'survived' if k.survived else 'FAILED'}{k.note}")
    bar.update(1)


def summary_table(s: dict, T: int, S: int) -> str:
    rows = [
        ("iterations / save interval", f"{T} / {S}"),
        ("kills survived", f"{s['kills_survived']} / {s['kills_planned']} (SIGKILL {s['sigkill']}, SIGTERM {s['sigterm']})"),
        ("kills inside saves", s["kills_inside_saves"]),
        ("kills landed inside background writes", s["kills_landed_inside_writes"]),
        ("save / write kills that landed off their aim", s["aimed_kills_off_target"]),
        ("attempts stopped at their cap before their kill", s["attempts_stopped_at_cap"]),
        ("steps redone", s["steps_redone"]),
        ("steps lost beyond the save interval", s["steps_lost_beyond_save_interval"]),
        ("iterations compared", s["iterations_compared"]),
        ("final-loss difference", s["final_loss_diff"]),
        ("max loss difference (every iteration)", s["max_loss_diff"]),
        ("max weight difference", s["max_weight_diff"]),
        ("max tensor difference (weights + optimizer)", s["max_tensor_diff"]),
        ("final checkpoint matches its checksums", s["final_checksums_match"]),
        ("incomplete checkpoints holding checksums", s["incomplete_with_checksums"]),
        ("time: reference / chaos (s)", f"{s['reference_s']} / {s['chaos_s']}"
                                         + (" (concurrent)" if not s["reference_s"] else "")),
        ("result", "OK" if s["ok"] else "MISMATCH"),
    ]
    return "\n".join(["| check | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows])


def main(argv=None) -> int:
    result = chaos(parse_args(argv))
    return 0 if result["summary"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
