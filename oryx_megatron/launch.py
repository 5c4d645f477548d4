"""SLURM launch support: distributed env for submitit tasks and the requeue exit contract.

A preempted or timed-out run (SIGTERM / SIGUSR1) finishes its step, saves a complete
checkpoint and leaves through :func:`exit_for_requeue`; the job is then requeued and
resumes from the ``latest`` checkpoint. See slurm/README.md.
"""

import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Mapping, NoReturn

log = logging.getLogger(__name__)

REQUEUE_EXIT_CODE = 3
"""Exit status of a trainer that saved its checkpoint and asks to be requeued."""

REQUEUE_MARKER_ENV = "ORYX_REQUEUE_MARKER"
"""Set by slurm/*.sbatch: a file the workers touch before exiting for requeue, because
torchrun (and srun around it) report their own exit status, not the workers' code 3."""

_MASTER_PORT_BASE, _MASTER_PORT_SPAN = 20000, 10000

# The first group of a compact node list: a prefix with bracketed ranges, up to a top-level comma.
_FIRST_GROUP = re.compile(r"[^,\[\]]*(?:\[[^\[\]]*\][^,\[\]]*)*")


def first_host(nodelist: str) -> str:
    """First hostname of a SLURM compact node list, as ``scontrol show hostnames`` orders it.

    ``gpu[001-004,007]`` -> ``gpu001``; ``a01,b02`` -> ``a01``; ``n[1-2]-ib[3-4]`` -> ``n1-ib3``.
    """
    group = _FIRST_GROUP.match(nodelist).group()
    if not group or nodelist[len(group):len(group) + 1] not in ("", ","):
        raise ValueError(f"unrecognised SLURM node list {nodelist!r}")
    # Each bracket contributes its first item, the start of a range keeping its zero padding.
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], group)


def slurm_master_port(job_id: str) -> int:
    """A port in 20000-29999 derived from the job id (slurm/train_multinode.sbatch uses the same)."""
    return _MASTER_PORT_BASE + int(job_id) % _MASTER_PORT_SPAN


def distributed_env_from_slurm(environ: Mapping[str, str] = os.environ) -> dict:
    """torch.distributed env vars for a SLURM task started without torchrun (e.g. by submitit).

    Returns RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (first host of the step's node list)
    and MASTER_PORT (kept if set, else derived from SLURM_JOB_ID) when RANK is absent and
    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID and a node list are present; otherwise {}.
    Apply with ``os.environ.update(...)`` before ``init_process_group``.
    """
    if "RANK" in environ or not all(k in environ for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")):
        return {}
    # The step's node list holds task 0 even when the step spans a subset of the job's nodes.
    nodelist = next(
        (environ[k] for k in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if environ.get(k)),
        None,
    )
    if nodelist is None:
        return {}
    if "MASTER_PORT" in environ:
        port = environ["MASTER_PORT"]
    elif "SLURM_JOB_ID" in environ:
        port = str(slurm_master_port(environ["SLURM_JOB_ID"]))
    else:
        raise ValueError("SLURM task without SLURM_JOB_ID: set MASTER_PORT")
    return {
        "RANK": environ["SLURM_PROCID"],
        "WORLD_SIZE": environ["SLURM_NTASKS"],
        "LOCAL_RANK": environ["SLURM_LOCALID"],
        "MASTER_ADDR": first_host(nodelist),
        "MASTER_PORT": port,
    }


def request_requeue(environ: Mapping[str, str] = os.environ) -> None:
    """Ask for this SLURM job to be requeued; every rank calls it once its checkpoint is complete.

    Under slurm/*.sbatch it touches $ORYX_REQUEUE_MARKER and the batch script requeues. Elsewhere
    in a SLURM job (submitit: the tasks are the trainer, no script wraps them) global rank 0 runs
    ``scontrol requeue``. Outside SLURM it does nothing.
    """
    marker = environ.get(REQUEUE_MARKER_ENV)
    if marker:
        path = Path(marker)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return
    job_id = environ.get("SLURM_JOB_ID")
    if job_id is None or environ.get("RANK", environ.get("SLURM_PROCID")) != "0":
        return
    result = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if result.returncode:
        log.warning("scontrol requeue %s failed (%d): %s", job_id, result.returncode, result.stderr.strip())
    else:
        log.info("requeued SLURM job %s", job_id)


def exit_for_requeue(environ: Mapping[str, str] = os.environ) -> NoReturn:
    """End a preempted run after its checkpoint is saved: request the requeue, exit with code 3."""
    request_requeue(environ)
    sys.exit(REQUEUE_EXIT_CODE)
