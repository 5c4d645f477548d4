"""Sequence-mixing kernels: pure-PyTorch implementations (CPU, and the test oracle) and CUDA
kernels with the same signatures, picked per op by `get_kernels`.

Layout everywhere: [batch, seq, heads, dim]; recurrent states [batch, heads, d_k, d_v].

    kernels = get_kernels()            # "auto": $ORYX_KERNEL_BACKEND, else CUDA where it runs
    o, state = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    kernels.names                      # {"chunk_gated_delta_rule": "fla", ...}

A CUDA kernel is chosen only where it may run and computes what the torch op does
(``selection``: known version/architecture conditions, then a one-time check on the GPU).
"""

import functools
import logging
import os
from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional

import torch

from . import cuda, selection
from .attention import block_sparse_causal_attention, causal_attention, decode_attention
from .conv import causal_conv1d, causal_conv1d_step
from .gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from .memo import once_per_tensor
from .norm import gated_rms_norm, upcast
from .rotary import apply_rotary, rotary_cos_sin, rotary_table
from .ssd import ssd_chunk_scan, ssd_step

BACKENDS = ("auto", "torch", "cuda")
BACKEND_ENV_VAR = "ORYX_KERNEL_BACKEND"


@dataclass(frozen=True)
class Kernels:
    """One implementation per op, and `names`: op -> implementation name."""

    causal_conv1d: Callable
    causal_conv1d_step: Callable
    chunk_gated_delta_rule: Callable
    gated_delta_rule_step: Callable
    ssd_chunk_scan: Callable
    ssd_step: Callable
    causal_attention: Callable
    block_sparse_causal_attention: Callable
    gated_rms_norm: Callable
    names: Dict[str, str]


logger = logging.getLogger(__name__)

OPS = tuple(f.name for f in fields(Kernels) if f.name != "names")
TORCH_OPS = {op: globals()[op] for op in OPS}


def get_kernels(backend: str = "auto", env: Optional[selection.KernelEnvironment] = None,
                probe: Optional[Callable[[str], Optional[str]]] = None) -> Kernels:
    """Kernels of a backend: "torch" (pure PyTorch), "cuda" (the CUDA kernels; RuntimeError naming
    what is missing or known broken), or "auto": the value of $ORYX_KERNEL_BACKEND when set, otherwise
    per op the CUDA kernel where it may run (``selection.refusal``) and passes its one-time check
    against the torch op (``probe``, on CUDA), else the torch op, with the reason logged.

    ``env`` (default: this machine) and ``probe`` (default: ``selection.probe`` on CUDA) are
    parameters so that the conditions can be injected."""
    source = "argument"
    if backend == "auto" and os.environ.get(BACKEND_ENV_VAR):
        backend, source = os.environ[BACKEND_ENV_VAR], f"${BACKEND_ENV_VAR}"
    if backend not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"unknown kernel backend {backend!r} (from {source}); allowed: {allowed}")
    if backend == "torch":
        return Kernels(**TORCH_OPS, names={op: "torch" for op in OPS})
    return _select(backend, env or selection.KernelEnvironment.detect(), probe or _probe_on_cuda)


@functools.lru_cache(maxsize=None)
def _select(backend: str, env: selection.KernelEnvironment, probe) -> Kernels:
    """Per op the CUDA kernel, or the torch op and why (once per process and environment)."""
    chosen, refused = {}, {}  # op -> function; op -> why not its CUDA kernel
    for op in OPS:
        reason = selection.refusal(op, env) or probe(op)
        if reason:
            chosen[op], refused[op] = TORCH_OPS[op], reason
        else:
            chosen[op] = getattr(cuda, op)
    if backend == "cuda" and refused:
        raise RuntimeError("kernel backend 'cuda' is unavailable here: "
                           + "; ".join(f"{op}: {why}" for op, why in refused.items()))
    for op, why in refused.items():
        if env.cuda:  # on a CPU machine the torch ops are the plan, not a fallback
            logger.warning("%s: the torch op runs instead of the CUDA kernel: %s", op, why)
    names = {op: "torch" if op in refused else selection.IMPLEMENTATIONS[op][0] for op in OPS}
    return Kernels(**chosen, names=names)


def _probe_on_cuda(op: str) -> Optional[str]:
    return selection.probe(op, getattr(cuda, op), TORCH_OPS[op]) if torch.cuda.is_available() else None


__all__ = [
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "Kernels",
    "get_kernels",
    "causal_conv1d",
    "causal_conv1d_step",
    "chunk_gated_delta_rule",
    "gated_delta_rule_step",
    "ssd_chunk_scan",
    "ssd_step",
    "causal_attention",
    "block_sparse_causal_attention",
    "gated_rms_norm",
    "decode_attention",
    "once_per_tensor",
    "apply_rotary",
    "rotary_cos_sin",
    "rotary_table",
    "upcast",
]
