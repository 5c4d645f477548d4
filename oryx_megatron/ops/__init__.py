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

from . import cuda, probe as probing, selection
from .attention import (
    BlockReads,
    attention_at,
    block_sparse_causal_attention,
    causal_attention,
    decode_attention,
)
from .conv import causal_conv1d, causal_conv1d_step
from .documents import Documents
from .gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from .norm import gated_rms_norm, kv_gate, upcast
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

    ``env`` (default: this machine) and ``probe`` (default: ``probe.probe`` on CUDA, which returns the
    verdicts a GPU session recorded where $ORYX_KERNEL_PROBES names them) are parameters so that the
    conditions can be injected."""
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
    """Per op the CUDA kernel; where only its backward is refused (or fails its check), the kernel for
    calls that need no gradient and the torch op for the others; else the torch op. Once per
    process and environment, with the reason logged."""
    chosen, names, refused = {}, {}, {}  # op -> function; op -> implementation name; op -> (why not, backward only)
    for op in OPS:
        implementation = selection.IMPLEMENTATIONS[op][0]
        reason = selection.refusal(op, env) or probe(op)
        if reason is None:
            chosen[op], names[op] = getattr(cuda, op), implementation
        elif selection.refusal(op, env, backward=False) is None and probe(op, backward=False) is None:
            chosen[op], names[op] = _without_grad(getattr(cuda, op), TORCH_OPS[op]), f"{implementation} without grad"
            refused[op] = (reason, True)
        else:
            chosen[op], names[op], refused[op] = TORCH_OPS[op], "torch", (reason, False)
    if backend == "cuda" and refused:
        raise RuntimeError("kernel backend 'cuda' is unavailable here: " + "; ".join(
            f"{op}{' (backward)' if backward_only else ''}: {why}" for op, (why, backward_only) in refused.items()))
    for op, (why, backward_only) in refused.items():
        if not env.cuda:  # on a CPU machine the torch ops are the plan, not a fallback
            continue
        if backward_only:
            logger.warning("%s: %s runs where no gradient is needed, the torch op where one is (training): %s",
                           op, names[op], why)
        else:
            logger.warning("%s: the torch op runs instead of the CUDA kernel: %s", op, why)
    return Kernels(**chosen, names=names)


def _without_grad(kernel: Callable, reference: Callable) -> Callable:
    """``kernel`` for calls that need no gradient (inference, evaluation), ``reference`` (the torch op,
    with its autograd) for the others."""

    @functools.wraps(kernel)
    def dispatch(*args, **kwargs):
        tensors = [a for a in (*args, *kwargs.values()) if torch.is_tensor(a)]
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
        return (reference if needs_grad else kernel)(*args, **kwargs)

    return dispatch


def _probe_on_cuda(op: str, backward: bool = True) -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    return probing.probe(op, getattr(cuda, op), TORCH_OPS[op], backward=backward)


__all__ = [
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "BlockReads",
    "Documents",
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
    "attention_at",
    "apply_rotary",
    "rotary_cos_sin",
    "rotary_table",
    "upcast",
    "kv_gate",
]
