"""Sequence-mixing kernels: pure-PyTorch implementations (CPU, and the test oracle) and CUDA
kernels with the same signatures, picked per op by `get_kernels`.

Layout everywhere: [batch, seq, heads, dim]; recurrent states [batch, heads, d_k, d_v].

    kernels = get_kernels()            # "auto": $ORYX_KERNEL_BACKEND, else CUDA where it runs
    o, state = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    kernels.names                      # {"chunk_gated_delta_rule": "fla", ...}
"""

import os
from dataclasses import dataclass, fields
from typing import Callable, Dict

from . import cuda
from .attention import causal_attention
from .conv import causal_conv1d, causal_conv1d_step
from .gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from .rotary import apply_rotary, rotary_cos_sin
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
    names: Dict[str, str]


OPS = tuple(f.name for f in fields(Kernels) if f.name != "names")
TORCH_OPS = {op: globals()[op] for op in OPS}


def get_kernels(backend: str = "auto") -> Kernels:
    """Kernels of a backend: "torch" (pure PyTorch), "cuda" (the CUDA kernels; RuntimeError naming
    what is missing), or "auto": the value of $ORYX_KERNEL_BACKEND when set, otherwise per op the
    CUDA kernel where CUDA is available and its package imports, else torch."""
    source = "argument"
    if backend == "auto" and os.environ.get(BACKEND_ENV_VAR):
        backend, source = os.environ[BACKEND_ENV_VAR], f"${BACKEND_ENV_VAR}"
    if backend not in BACKENDS:
        allowed = ", ".join(BACKENDS)
        raise ValueError(f"unknown kernel backend {backend!r} (from {source}); allowed: {allowed}")

    chosen, missing = {}, []  # op -> (implementation name, function); "op: why not cuda"
    for op in OPS:
        reason = "torch requested" if backend == "torch" else cuda.unavailable(op)
        chosen[op] = ("torch", TORCH_OPS[op]) if reason else (cuda.IMPLEMENTATIONS[op][0], getattr(cuda, op))
        if backend == "cuda" and reason:
            missing.append(f"{op}: {reason}")
    if missing:
        raise RuntimeError(f"kernel backend 'cuda' is unavailable here: {'; '.join(missing)}")
    names = {op: name for op, (name, _) in chosen.items()}
    return Kernels(**{op: fn for op, (_, fn) in chosen.items()}, names=names)


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
    "apply_rotary",
    "rotary_cos_sin",
]
