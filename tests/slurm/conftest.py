"""tests/slurm run against the one-node SLURM cluster that `make test-slurm` (tests/slurm/cluster.sh) starts;
without it (`make test`, a plain pytest) the folder is skipped."""

import os

import pytest

collect_ignore_glob = [] if os.environ.get("ORYX_SLURM_CLUSTER") else ["*.py"]


@pytest.fixture(autouse=True)
def cancel_jobs():
    """Cancel what a test submitted and left in the queue (it failed), so that the next test has the node."""
    from tests.slurm import jobs

    yield
    for job_id in jobs.SUBMITTED:
        jobs.slurm("scancel", "--signal=KILL", "--full", job_id, check=False)
        jobs.slurm("scancel", job_id, check=False)
    jobs.SUBMITTED.clear()
