"""Process-group and model-parallel set-up shared by the entry points and tests.

Set up once per process: ``initialize_parallel`` with the layout already in place only reseeds,
and a new layout destroys the old groups first (a gloo group holds its threads until destroyed).
``destroy_parallel`` tears everything down, the default process group included.
"""

import os
from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from oryx_megatron.compat.cpu import apply_cpu_compat
from oryx_megatron.compat.megatron import batch_on_this_cp_rank
from oryx_megatron.launch import distributed_env_from_slurm

DEFAULT_TIMEOUT_MINUTES = 10.0  # parallel.distributed_timeout_minutes


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
    context_parallel_size: int = 1,
) -> None:
    """Start torch.distributed (nccl on CUDA, gloo on CPU) and megatron's parallel state.

    Under torchrun the rendezvous comes from the environment (under a SLURM task without
    torchrun, from SLURM's variables); a plain process becomes a world of one.
    ``timeout_minutes`` (``parallel.distributed_timeout_minutes``): a collective that waits
    longer for a dead or hung rank raises on the others instead of hanging (every group's
    timeout; on NCCL with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, torch's default, the watchdog
    aborts the process). Only the first call in a process sets it. ``context_parallel_size``: ranks that split
    every sequence (world = TP x CP x PP x DP, megatron's groups).
    """
    timeout = timedelta(minutes=timeout_minutes)
    apply_cpu_compat()
    os.environ.update(distributed_env_from_slurm())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    layout = (tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
              context_parallel_size)
    if _current_layout() != layout:
        _destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            context_parallel_size=context_parallel_size,
            distributed_timeout_minutes=timeout_minutes,
        )
    elif virtual_pipeline_model_parallel_size is not None:
        parallel_state.set_virtual_pipeline_model_parallel_rank(0)  # a finished run may have left it
    model_parallel_cuda_manual_seed(seed)


def current_device() -> torch.device:
    """This rank's device: its CUDA device (set from LOCAL_RANK), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def destroy_parallel() -> None:
    """Destroy megatron's parallel state and every process group, the default one included."""
    _destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _current_layout() -> Optional[Tuple[int, int, Optional[int], int]]:
    """(TP, PP, VP, CP) sizes of the parallel state in place, or None."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    return (
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        parallel_state.get_context_parallel_world_size(),
    )


def _destroy_model_parallel() -> None:
    """Megatron's destroy_model_parallel forgets its groups without destroying them: destroy every
    group but the default one."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


def this_rank_tokens(**tensors: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Each [b, s] tensor's tokens of this context-parallel rank: megatron's load-balanced split
    (``get_batch_on_this_cp_rank``: sequence chunks r and 2cp - 1 - r of 2cp); all of them without context
    parallelism. What the model reads whole (modes, document ids) is not split."""
    return batch_on_this_cp_rank(dict(tensors))


def context_parallel() -> bool:
    """Whether sequences are split over more than one context-parallel rank."""
    return parallel_state.get_context_parallel_world_size() > 1


def whole_sequences(t: torch.Tensor) -> torch.Tensor:
    """The inverse of ``this_rank_tokens``: [b, s / cp] of every context-parallel rank -> [b, s] in order."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_context_parallel_group())
    chunks = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)
