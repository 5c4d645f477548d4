"""Jobs on the test cluster (tests/slurm/cluster.sh): submit slurm/*.sbatch with a tiny run, watch the job and
its run directory, read its losses."""

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List

import psutil

from tests.test_train import TINY_MODEL, TINY_TRAIN

REPO = Path(__file__).resolve().parents[2]
SLURM_DIR = REPO / "slurm"
# The venv's commands (torchrun, python) first on PATH: sbatch passes the submitting environment to the job.
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
TINY_ITERS, SAVE_INTERVAL = 50, 10
SUBMITTED: List[str] = []  # job ids, for conftest.cancel_jobs


def tiny_run(corpus: dict, root: Path, *overrides: str) -> List[str]:
    """Overrides of a tiny Oryx-TG run on ``corpus`` (1 layer, 2 sequences of 64 tokens a step): checkpoints every
    SAVE_INTERVAL iterations into root/ckpt, its metrics in root/run."""
    return [*TINY_MODEL, *TINY_TRAIN, "model.num_layers=1", "train.global_batch_size=2",
            f"data.data_path=[{corpus['shards']}]", f"train.train_iters={TINY_ITERS}", f"checkpoint.save_interval={SAVE_INTERVAL}",
            f"checkpoint.dir={root / 'ckpt'}", f"hydra.run.dir={root / 'run'}", *overrides]


def losses(run_dir: Path) -> Dict[int, float]:
    """iteration -> train/loss of a run directory's metrics.jsonl."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {row["iteration"]: row["train/loss"] for row in rows if "train/loss" in row}


def slurm(*args: str, check: bool = True) -> str:
    result = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=60)
    if check and result.returncode:
        raise RuntimeError(f"{' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
    return result.stdout.strip()


@dataclass
class Job:
    id: str
    workdir: Path  # the submit directory: logs/ lies there

    @property
    def log(self) -> str:
        logs = list((self.workdir / "logs").glob(f"*-{self.id}.out"))
        return logs[0].read_text(errors="replace") if logs else ""

    def info(self) -> Dict[str, str]:
        """scontrol's fields of the job (JobState, Restarts, Reason, ExitCode, ...)."""
        text = slurm("scontrol", "show", "job", "-o", self.id)
        return dict(field.split("=", 1) for field in text.split() if "=" in field)

    def wait_for(self, predicate, what: str, timeout: float = 300):
        """Poll until predicate(info) holds."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if predicate(info):
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"job {self.id}: no {what} in {timeout} s: {info}\n{self.log}")
            time.sleep(0.5)

    def done(self, timeout: float = 600) -> Dict[str, str]:
        return self.wait_for(lambda i: i["JobState"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
                             "end", timeout)


def sbatch(workdir: Path, *args: str, script: str = "train.sbatch", **env: str) -> Job:
    """Submit slurm/<script> from ``workdir`` (sbatch options, then Hydra overrides, in ``args``)."""
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["sbatch", "--parsable", *_options(args), str(SLURM_DIR / script), *_overrides(args)],
                            cwd=workdir, capture_output=True, text=True, env={**ENV, **env}, timeout=60)
    assert result.returncode == 0, result.stderr
    SUBMITTED.append(result.stdout.strip().split(";")[0])
    return Job(SUBMITTED[-1], workdir)


def _options(args):
    return [a for a in args if a.startswith("-")]


def _overrides(args):
    return [a for a in args if not a.startswith("-")]


@contextmanager
def held(job: Job, run_dir: Path, iteration: int, timeout: float = 300):
    """Wait until the run has logged ``iteration``, then stop the job's training workers (torchrun's children:
    SIGSTOP) inside, so that the run cannot end before the signal a test sends, however fast this machine trains;
    SIGCONT after, which delivers the signal."""
    deadline, torchruns, workers = time.monotonic() + timeout, [], []
    while not workers:
        assert time.monotonic() < deadline, f"job {job.id}: no iteration {iteration} in {timeout} s\n{job.log}"
        if not torchruns:  # this job's torchrun processes (their environment names the job)
            torchruns = [proc for proc in psutil.process_iter(["cmdline", "environ"])
                         if any(arg.endswith("torchrun") for arg in proc.info["cmdline"] or [])
                         and (proc.info["environ"] or {}).get("SLURM_JOB_ID") == job.id]
        if torchruns and max(losses(run_dir), default=0) >= iteration:
            workers = [child for proc in torchruns for child in proc.children()]
            for worker in workers:
                worker.suspend()
        time.sleep(0.05)
    try:
        yield workers
    finally:
        for worker in workers:
            if worker.is_running():
                worker.resume()
