"""Running one training attempt of the chaos driver and watching it: its metrics as they are appended,
the checkpoint saves in progress, the kill when it is armed (and where it landed: the process group is
stopped, looked at, then signalled), and what its process group leaves behind."""

import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from oryx_megatron.checks.chaos.plan import Kill

POLL_S = 0.002
EARLY_RETRY_S = 0.002  # a write kill that came before its write began tries again after this
STOP_WAIT_S = 1.0  # how long SIGSTOP may take to stop the group (a process in uninterruptible I/O stops after it)
TRAINER_NICE = 10  # the trainers run at a lower priority: on a loaded machine the driver still reacts within a poll
WRITER_NAME = "oryx-ckpt-write"  # oryx_megatron.training.saving.WRITER_NAME (not imported: keeps the driver light)


@dataclass
class Stats:
    step_s: List[float] = field(default_factory=list)
    save_s: List[float] = field(default_factory=list)  # saves after the first of a process
    first_save_s: List[float] = field(default_factory=list)  # + starting megatron's writer Manager process
    write_s: List[float] = field(default_factory=list)  # async saves' background writes (checkpoint/background_s)
    leftovers: List[int] = field(default_factory=list)  # processes of each attempt's group alive after it ended
    max_poll_gap_s: float = 0.0  # the longest sleep between two looks at an attempt (POLL_S + being descheduled)

    def step_time(self) -> float:
        return sorted(self.step_s)[len(self.step_s) // 2] if self.step_s else 0.05

    def save_time(self, first: bool = False) -> float:
        """The shortest save seen (of a process's first saves, or of the others): kills within it land inside."""
        seen = self.first_save_s if first else self.save_s
        return min(seen) if seen else 0.02

    def write_time(self) -> float:
        """The shortest background write of an async save seen: kills within it land inside."""
        return min(self.write_s) if self.write_s else 0.02


class MetricsTail:
    """The rows of a metrics.jsonl as they are appended (a line cut by a SIGKILL is skipped)."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rows, self.buffer = path, 0, [], ""
        self.arrived: List[Tuple[float, int]] = []

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            chunk = f.read()
            self.offset = f.tell()
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            row = parse_row(line)
            if row is not None:
                self.rows.append(row)
                if "train/loss" in row:
                    self.arrived.append((time.monotonic(), row["iteration"]))

    def finish(self) -> None:
        self.poll()
        if self.buffer:
            row = parse_row(self.buffer)
            if row is not None:
                self.rows.append(row)
            self.buffer = ""

    @property
    def last(self) -> int:
        return max((row["iteration"] for row in self.rows if "train/loss" in row), default=-1)


def parse_row(line: str) -> Optional[dict]:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("iteration"), int) else None


def latest_iteration(ckpt_dir: Path) -> int:
    try:
        return int((ckpt_dir / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def written_since(ckpt_dir: Path, since: float) -> List[int]:
    """Iterations whose directory this process created or rewrote: a save (re)creates the directory
    first; older trainers wrote run_config.yaml into a kept directory first, so its mtime counts too."""
    found = []
    try:
        entries = list(os.scandir(ckpt_dir))
    except OSError:
        return found
    for entry in entries:
        if not (entry.name.startswith("iter_") and entry.is_dir()):
            continue
        try:
            stamp = entry.stat().st_mtime
            config = Path(entry.path) / "run_config.yaml"
            if config.exists():
                stamp = max(stamp, config.stat().st_mtime)
        except OSError:
            continue
        if stamp >= since:
            found.append(int(entry.name[5:]))
    return found


class SaveWatch:
    """Saves in progress (an iteration dir newer than `latest`) and how long completed ones took."""

    def __init__(self, ckpt_dir: Path, since: float, stats: Stats):
        self.ckpt_dir, self.since, self.stats = ckpt_dir, since, stats
        self.started: Dict[int, float] = {}
        self.completed = 0

    def poll(self) -> None:
        latest = latest_iteration(self.ckpt_dir)
        for it in written_since(self.ckpt_dir, self.since):
            if it > latest and it not in self.started:
                self.started[it] = time.monotonic()
        for it in [it for it in self.started if it <= latest]:
            seconds = time.monotonic() - self.started.pop(it)
            (self.stats.save_s if self.completed else self.stats.first_save_s).append(seconds)
            self.completed += 1


def run_attempt(cmd: List[str], env: dict, run_dir: Path, ckpt_dir: Path, log_path: Path, kill: Optional[Kill],
                rng: random.Random, stats: Stats, timeout: float) -> Tuple[int, MetricsTail, float]:
    """Run one training process to its end, delivering `kill` when it is armed."""
    since = time.time()
    proc = start_trainer(cmd, env, log_path)
    tail, saves = MetricsTail(run_dir / "metrics.jsonl"), SaveWatch(ckpt_dir, since, stats)
    deadline, fire_at, armed_save, missed = time.monotonic() + timeout, None, None, False
    looked = time.monotonic()
    try:
        while proc.poll() is None:
            stats.max_poll_gap_s = max(stats.max_poll_gap_s, time.monotonic() - looked)
            tail.poll()
            saves.poll()
            if kill is not None and not kill.sent:
                aimed = _aim(kill, tail, saves, stats, rng, missed) if fire_at is None else None
                if aimed is not None:
                    delay, armed_save = aimed
                    fire_at = time.monotonic() + delay
                    if armed_save is not None:
                        kill.events.append(f"{time.time() - since:.3f}: {kill.aim} of {armed_save} seen, "
                                           f"kill in {delay:.3f} s")
                if armed_save is not None and armed_save not in saves.started:
                    kill.events.append(f"{time.time() - since:.3f}: save of {armed_save} finished first")
                    fire_at, armed_save, missed = None, None, True  # kill inside the next one at once
                if fire_at is not None and time.monotonic() >= fire_at:
                    outcome = _fire(kill, proc, ckpt_dir, since, armed_save)
                    if outcome == "early":  # its write has not begun: a little later
                        fire_at = time.monotonic() + EARLY_RETRY_S
                    elif outcome == "over":  # past its aim: inside the next save at once
                        fire_at, armed_save, missed = None, None, True
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise TimeoutError(f"{' '.join(cmd)} ran past {timeout:.0f} s; see {log_path}")
            looked = time.monotonic()
            time.sleep(POLL_S)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reap_group(proc.pid)
        raise
    stats.leftovers.append(reap_group(proc.pid))
    tail.finish()
    saves.poll()
    times = [t for t, _ in tail.arrived]
    stats.step_s += [b - a for a, b in zip(times, times[1:]) if b - a < 1.0]  # not the 1st save's pause
    stats.write_s += [row["checkpoint/background_s"] for row in tail.rows if "checkpoint/background_s" in row]
    return proc.returncode, tail, since


def start_trainer(cmd: List[str], env: dict, log_path: Path) -> subprocess.Popen:
    """A training process in a process group of its own, at TRAINER_NICE, its console to log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=lambda: os.nice(TRAINER_NICE))


def _fire(kill: Kill, proc: subprocess.Popen, ckpt_dir: Path, since: float, armed_save: Optional[int]) -> str:
    """Stop the trainer's process group, record where the kill lands (``landing``) and signal it: "sent". But
    when a save or write kill finds its save outside its aim, let the group go on: "early" when a write kill's
    save has no shard file yet (its writer, forked moments ago, has not begun: not yet named WRITER_NAME),
    "over" when the save is past its aim (ended, or its writers have; recorded in ``kill.missed``)."""
    freeze(proc.pid)
    where, iteration, writers, files = landing(proc.pid, ckpt_dir, since)
    stamp = f"{time.time() - since:.3f}"
    if kill.aim != "step" and where != kill.aim:
        os.killpg(proc.pid, signal.SIGCONT)
        early = kill.aim == "write" and where == "save" and not any(f.endswith(".distcp") for f in files)
        kill.events.append(f"{stamp}: stopped {where}, {'before' if early else 'after'} the {kill.aim} of "
                           f"{armed_save}: continued")
        if early:
            return "early"
        kill.missed.append(armed_save)
        return "over"
    if kill.signal == "SIGKILL":  # a dead node: the trainer and every process it started
        os.killpg(proc.pid, signal.SIGKILL)
    else:  # preemption: the scheduler signals the trainer, which saves and exits
        proc.send_signal(signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGCONT)
    kill.sent = True
    kill.landed, kill.landed_iteration, kill.writers_at_kill, kill.files_at_kill = where, iteration, writers, files
    kill.events.append(f"{stamp}: {kill.signal} sent, landed: {where}")
    return "sent"


def _aim(kill: Kill, tail: MetricsTail, saves: SaveWatch, stats: Stats, rng: random.Random,
         missed: bool) -> Optional[Tuple[float, Optional[int]]]:
    """Once ``kill`` is armed (its target iteration logged and, for a save or write kill, the save it aims
    at begun): the delay before it fires and the iteration of that save (None for a step kill); else None.
    A save kill aims at a save in progress (its directory newer than `latest`), a write kill at an async
    save whose blocking part is over (its checkpoint/blocking_s row is logged) and that has not completed:
    at a random point of the shortest such span seen, or, after a miss (the load varies), at once. A save found
    over when the kill fired (``kill.missed``) is not aimed at again."""
    if tail.last < kill.target:
        return None
    if kill.aim == "step":
        return rng.uniform(0.0, stats.step_time()), None
    if kill.aim == "write":
        scheduled = {row["iteration"] for row in tail.rows if "checkpoint/blocking_s" in row}
        aims, shortest = [it for it in saves.started if it in scheduled], stats.write_time()
    else:
        aims, shortest = list(saves.started), stats.save_time(first=saves.completed == 0)
    aims = [it for it in aims if it >= kill.target and it not in kill.missed]
    if not aims:
        return None
    return (0.0 if missed else rng.uniform(0.0, 0.5 * shortest)), max(aims)


def _group(pgid: int) -> List[Tuple[int, str, str]]:
    """(pid, state, name) of each process of a process group, from /proc (none where there is no /proc)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                head, tail = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)
                state, _, pgrp = tail.split()[:3]
            except (OSError, IndexError, ValueError):
                continue
            if int(pgrp) == pgid:
                members.append((int(entry), state, head.split("(", 1)[1]))
    return members


def _group_size(pgid: int) -> int:
    """Live (not zombie) processes of a process group."""
    return sum(state != "Z" for _, state, _ in _group(pgid))


def freeze(pgid: int) -> None:
    """SIGSTOP a process group and wait (at most STOP_WAIT_S) until each of its processes has stopped or ended."""
    try:
        os.killpg(pgid, signal.SIGSTOP)
    except ProcessLookupError:  # it has ended
        return
    deadline = time.monotonic() + STOP_WAIT_S
    while any(state not in "TtZX" for _, state, _ in _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.001)


def landing(pgid: int, ckpt_dir: Path, since: float) -> Tuple[str, Optional[int], int, Dict[str, int]]:
    """Where a kill of the (stopped) process group lands: "write" while a writer process of an async save is
    alive (named WRITER_NAME: the writer and the workers it forks), else "save" while a save this attempt began
    is in progress (its directory newer than `latest`), else "step"; the newest save in progress, the writer
    processes alive and that save's files then (name -> bytes)."""
    writers = sum(name == WRITER_NAME and state not in "ZX" for _, state, name in _group(pgid))
    saving = [it for it in written_since(ckpt_dir, since) if it > latest_iteration(ckpt_dir)]
    files = {}
    try:
        for entry in os.scandir(ckpt_dir / f"iter_{max(saving):07d}") if saving else []:
            files[entry.name] = entry.stat().st_size
    except OSError:  # removed meanwhile (the group did not stop within STOP_WAIT_S)
        pass
    where = "write" if writers else "save" if saving else "step"
    return where, max(saving) if saving else None, writers, files


def reap_group(pgid: int) -> int:
    """SIGKILL what is left of a trainer's process group 2 s after the trainer ended (e.g. the
    checkpoint writer's multiprocessing Manager when the trainer was killed); returns how many."""
    deadline = time.monotonic() + 2.0
    while (left := _group_size(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return left
