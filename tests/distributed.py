"""Run a test body in N gloo processes (CPU; forked from tests/processes.py's server), re-raising the first
failure."""

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oryx_megatron.parallel import destroy_parallel
from tests.processes import enter


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, env, cwd, fn, args):
    enter(env, cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    torch.set_num_threads(1)  # one core per rank: oversubscribed threads slow CPU kernels many-fold
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(*args)
    except BaseException:
        traceback.print_exc()  # every rank's failure, not only the first to reach spawn
        raise
    finally:
        destroy_parallel()


def run_distributed(fn, *args, world_size: int = 2) -> None:
    """fn(*args) on every rank; fn must be importable (module level)."""
    mp.start_processes(_worker, args=(world_size, _free_port(), dict(os.environ), os.getcwd(), fn, args),
                       nprocs=world_size, join=True, start_method="forkserver")
