"""Process-group and model-parallel set-up shared by the entry points and tests."""

import os
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from oryx_megatron.compat.cpu import apply_cpu_compat
from oryx_megatron.launch import distributed_env_from_slurm


def initialize_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    seed: int = 1234,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
) -> None:
    """Start torch.distributed (nccl on CUDA, gloo on CPU) and megatron's parallel state.

    Under torchrun the rendezvous comes from the environment (under a SLURM task without
    torchrun, from SLURM's variables); a plain process becomes a world of one.
    """
    apply_cpu_compat()
    os.environ.update(distributed_env_from_slurm())
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ:
            if torch.cuda.is_available():
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
    )
    model_parallel_cuda_manual_seed(seed)
