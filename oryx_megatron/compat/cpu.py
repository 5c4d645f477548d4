"""A small CPU compatibility shim for megatron-core, applied only when CUDA is absent.

megatron-core hard-codes CUDA in a few places that the model path reaches.
Each patch below names what it gets past:

1. ``torch.cuda.current_device()`` places global memory buffers (sequence-parallel
   all-gather) and conv/param tensors -> returns ``"cpu"``.
2. The model-parallel RNG tracker forks the CUDA generator even with dropout 0 ->
   its get/set state is redirected to the CPU generator.
3. ``torch.cuda.synchronize`` (dist_checkpointing's file writer) -> a no-op;
   ``torch.cuda.current_stream()`` (DDP's grad sync from megatron-core 0.19 waits on it every
   step) -> the CPU stream (``torch.cpu.current_stream()``: its waits are no-ops).
4. The optimizer, DDP and grad clipping create tensors with ``device='cuda'``, call
   ``.cuda()`` and assert ``grad.type() == 'torch.cuda.FloatTensor'``, and context-parallel rotary
   asks for ``pin_memory=True``: ``cuda_to_cpu()`` is a TorchFunctionMode that maps those to the CPU;
   the training step runs inside it (a no-op context with CUDA).

Every model config built here also turns the CUDA-only fusions off
(``oryx_megatron.layers.config.cpu_friendly_defaults``); set ``TORCHDYNAMO_DISABLE=1``
on CPU (the Makefile does) so megatron's ``jit_fuser`` does not compile. Norms are plain
``torch.nn.RMSNorm`` (``oryx_megatron.layers.norms``), since megatron's
``WrappedTorchNorm`` refuses sequence parallelism.
"""

import contextlib

import torch
from torch.overrides import TorchFunctionMode

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
    torch.cuda.current_stream = torch.cpu.current_stream

    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
    mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()

    _applied = True
    return True


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # 'torch.cuda.FloatTensor' checks
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # no pinned memory without an accelerator (context parallel rotary)
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


def cuda_to_cpu(needed: bool = True):
    """Context in which megatron's hard-coded CUDA tensors land on the CPU (only without CUDA, and where the caller
    says it is ``needed``: the mode costs every torch call a round trip through Python)."""
    return _CudaToCpu() if needed and not torch.cuda.is_available() else contextlib.nullcontext()
