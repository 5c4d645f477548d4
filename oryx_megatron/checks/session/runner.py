"""One stage of the GPU session: a process of its own under a time limit, watched while it runs."""

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, List, Tuple

POLL_S = 2.0  # how often a running stage's results are folded into what comes back


def run_stage(argv: List[str], cwd: Path, log: Path, limit_s: float, grace_s: float, env: dict,
              progress: Callable[[], None] = lambda: None) -> Tuple[int, float]:
    """Run ``argv`` with its output in ``log``, calling ``progress`` every POLL_S seconds while it runs
    (so that its finished rows come back even if the whole call is cut). At ``limit_s`` SIGTERM its
    process group, SIGKILL after ``grace_s`` (as ``timeout -k``: the training loop catches SIGTERM to
    save for requeue and would run on). Returns (exit code: 124 when stopped at the limit; seconds)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = _wait(proc, start + limit_s, progress)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = 124
        finally:
            if proc.poll() is None:  # the driver itself was interrupted: leave nothing running
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    progress()
    return code, round(time.perf_counter() - start, 1)


def _wait(proc: subprocess.Popen, until: float, progress: Callable[[], None]) -> int:
    """The exit code of ``proc``, calling ``progress`` every POLL_S; TimeoutExpired at ``until``."""
    while True:
        try:
            return proc.wait(timeout=max(0.0, min(POLL_S, until - time.perf_counter())))
        except subprocess.TimeoutExpired:
            if time.perf_counter() >= until:
                raise
            progress()
