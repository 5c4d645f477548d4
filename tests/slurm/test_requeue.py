"""Every way SLURM ends a job ends in a requeue that resumes from the last checkpoint (losing at most one save
interval), with the losses of an uninterrupted run bit for bit: slurm/*.sbatch with a tiny model on the test
cluster (tests/slurm/cluster.sh: partition `low` preempted by `high` after a grace time, the default KillWait)."""

import re

import pytest

from tests.slurm.jobs import SAVE_INTERVAL, TINY_ITERS, held, losses, sbatch, slurm, tiny_run

MULTINODE = ("--nodes=1", "--ntasks-per-node=2", "train.micro_batch_size=1")  # 2 workers on the node: DP=2


def straight_run(corpus, root, *args, script="train.sbatch"):
    job = sbatch(root, *tiny_run(corpus, root), *args, script=script)
    info = job.done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.log
    curve = losses(root / "run")
    assert sorted(curve) == list(range(1, TINY_ITERS + 1))
    return job, curve


@pytest.fixture(scope="session")
def straight(corpus, tmp_path_factory):
    """An uninterrupted run through slurm/train.sbatch on the CPU node, as slurm/README.md submits it: one
    worker (no GPUs, one task)."""
    job, curve = straight_run(corpus, tmp_path_factory.mktemp("straight"))
    assert "--nproc-per-node=1 " in job.log
    return curve


@pytest.fixture(scope="session")
def straight_multinode(corpus, tmp_path_factory):
    """An uninterrupted run through slurm/train_multinode.sbatch: 1 node, 2 tasks, so 2 workers (c10d)."""
    job, curve = straight_run(corpus, tmp_path_factory.mktemp("straight_multinode"), *MULTINODE,
                              script="train_multinode.sbatch")
    assert "--nproc-per-node=2 " in job.log
    return curve


def check_resumed(job, root, straight):
    """The job ended COMPLETED after a requeue; each attempt that trained resumed at most SAVE_INTERVAL
    iterations before the last one logged before it; the run logged the losses of the uninterrupted run, bit for
    bit."""
    info = job.done()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.log
    assert int(info["Restarts"]) >= 1, job.log
    attempts = re.split(r"(?:^|\n)job \d+ \(restart \d+\)", job.log)[1:]
    assert len(attempts) == int(info["Restarts"]) + 1, job.log
    trained = 0  # the last iteration logged so far
    for attempt in attempts:
        iterations = [int(n) for n in re.findall(r"\] - iter +(\d+) \|", attempt)]
        resumed = re.findall(r"resumed from \S+ at iteration (\d+)", attempt)
        if iterations:  # an attempt signalled while it started trained nothing
            assert int(resumed[0]) >= trained - SAVE_INTERVAL if resumed else trained < SAVE_INTERVAL, job.log
            trained = max(trained, *iterations)
    assert losses(root / "run") == straight, job.log


def held_job(corpus, root, *args, script="train.sbatch"):
    """A job of the tiny run, held past its first save while a test signals it."""
    job = sbatch(root, *tiny_run(corpus, root), *args, script=script)
    return job, held(job, root / "run", SAVE_INTERVAL + 2)


def preempt(job) -> None:
    """Submit a job to the higher-tier partition that needs every CPU of the node: it preempts ``job``
    (PreemptMode=REQUEUE, after the grace time) and ends at once."""
    cpus = slurm("sinfo", "-h", "-o", "%c").split()[0]
    slurm("sbatch", "-p", "high", f"--ntasks={cpus}", "--output=/dev/null", "--wrap", "true")


def signalled(job, marker):
    """Wait until the job's log shows ``marker`` (the script caught the signal)."""
    job.wait_for(lambda info: marker in job.log, marker, 180)


def test_scancel_signal_term_batch(corpus, tmp_path, straight):
    # With W&B (offline): the script's SIGTERM goes to the workers only, and W&B's service lives on.
    job, holding = held_job(corpus, tmp_path, "logging.wandb_mode=offline")
    with holding:
        slurm("scancel", "--signal=TERM", "--batch", job.id)
        signalled(job, "caught TERM to the shell")
    check_resumed(job, tmp_path, straight)
    assert "W&B disabled" not in job.log and "W&B run (offline)" in job.log


def test_time_limit_signal(corpus, tmp_path, straight):
    # USR1 to the batch shell 2 minutes before a 3-minute limit: ~1 minute after each start (the trainer is
    # held from iteration 12 until then).
    job, holding = held_job(corpus, tmp_path, "--time=3", "--signal=B:USR1@120")
    with holding:
        signalled(job, "caught USR1 to the shell")
    check_resumed(job, tmp_path, straight)


def test_partition_preemption_with_grace_time(corpus, tmp_path, straight):
    # SLURM signals the job's steps when the grace starts (not the batch shell; no preempt_send_user_signal).
    job, holding = held_job(corpus, tmp_path)
    with holding:
        preempt(job)
        signalled(job, "caught TERM to the job steps")
    check_resumed(job, tmp_path, straight)
    assert "caught TERM to the job steps: sending SIGTERM to the trainer" in job.log
    assert "SIGTERM received: saving and exiting for requeue" in job.log


def test_second_preemption_while_starting(corpus, tmp_path, straight):
    job, holding = held_job(corpus, tmp_path)
    with holding:
        preempt(job)
        signalled(job, "caught TERM to the job steps")
    job.wait_for(lambda i: i["JobState"] == "RUNNING" and i["Restarts"] == "1", "restart", 300)
    preempt(job)  # the requeued job has not trained yet
    check_resumed(job, tmp_path, straight)
    assert int(job.info()["Restarts"]) >= 2


def test_scontrol_requeue(corpus, tmp_path, straight):
    # SLURM signals every process of the job (torchrun too) and kills what is left after KillWait.
    job, holding = held_job(corpus, tmp_path)
    with holding:
        slurm("scontrol", "requeue", job.id)
        signalled(job, "DUE TO JOB REQUEUE")
    check_resumed(job, tmp_path, straight)
    assert "DUE TO JOB REQUEUE" in job.log and "SIGTERM received: saving and exiting for requeue" in job.log


def test_signal_while_starting(corpus, tmp_path, straight):
    # Before the trainer's handlers are installed: the script requeues, the run starts again from scratch.
    job = sbatch(tmp_path, *tiny_run(corpus, tmp_path))
    job.wait_for(lambda i: i["JobState"] == "RUNNING" and "(restart 0)" in job.log, "start", 300)
    slurm("scancel", "--signal=TERM", "--batch", job.id)
    check_resumed(job, tmp_path, straight)
    assert "resumed from" not in job.log.split("(restart 1)")[0]


def test_multinode_preemption(corpus, tmp_path, straight_multinode):
    job, holding = held_job(corpus, tmp_path, *MULTINODE, script="train_multinode.sbatch")
    with holding:
        preempt(job)
        signalled(job, "caught TERM to the job steps")
    check_resumed(job, tmp_path, straight_multinode)
    assert "the trainers have it from SLURM" in job.log
