"""A small CPU compatibility shim for megatron-core, applied only when CUDA is absent.

megatron-core hard-codes CUDA in a few places that the model path reaches
(see ../shared/notes/platform.md). Each patch below names what it gets past:

1. ``torch.cuda.current_device()`` places global memory buffers (sequence-parallel
   all-gather) and conv/param tensors -> returns ``"cpu"``.
2. The model-parallel RNG tracker forks the CUDA generator even with dropout 0 ->
   its get/set state is redirected to the CPU generator.
3. ``torch.cuda.synchronize`` (dist_checkpointing's file writer) -> a no-op.

Every model config built here also turns the CUDA-only fusions off
(``oryx_megatron.config.cpu_friendly_defaults``); set ``TORCHDYNAMO_DISABLE=1``
on CPU (the Makefile does) so megatron's ``jit_fuser`` does not compile. Norms are plain
``torch.nn.RMSNorm`` (``oryx_megatron.layers.norms``), since megatron's
``WrappedTorchNorm`` refuses sequence parallelism.
"""

import torch

_applied = False


def apply_cpu_compat() -> bool:
    """Patch megatron-core for CPU once; returns True when the shim is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True

    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None

    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()

    _applied = True
    return True
