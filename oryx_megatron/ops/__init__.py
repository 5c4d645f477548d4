"""Sequence-mixing kernels: pure-PyTorch implementations (CPU, and the test oracle) and CUDA
kernels with the same signatures, picked per op by `get_kernels`.

Layout everywhere: [batch, seq, heads, dim]; recurrent states [batch, heads, d_k, d_v].

    kernels = get_kernels()            # "auto": $ORYX_KERNEL_BACKEND, else CUDA where it runs
    o, state = kernels.chunk_gated_delta_rule(q, k, v, g, beta)
    kernels.names                      # {"chunk_gated_delta_rule": "fla", ...}

Each op is declared once (``registry.KernelOp``: its torch op, its CUDA kernel, when that kernel may run, the
inputs of its check; the project's own in ``builtin``); a mixer's module declares its own with
``register_op``. A CUDA kernel is chosen only where it may run and computes what the torch op does
(``selection``: the op's version/architecture conditions, then a one-time check on the GPU, ``probe``).
"""

import functools
import logging
import os
from typing import Callable, Dict, Optional, Tuple

import torch

from .builtin import BUILTIN  # noqa: F401  (registers the project's own ops)
from .attention import (
    BlockReads,
    attention_at,
    block_sparse_causal_attention,
    causal_attention,
    decode_attention,
)
from .chunking import cast, compute_dtype
from .conv import causal_conv1d, causal_conv1d_step
from .documents import Documents
from .gated_delta_rule import chunk_gated_delta_rule, gated_delta_rule_step
from .norm import gated_rms_norm, kv_gate, upcast
from .probe import probe as probe_kernel
from .registry import OPS, KernelOp, cuda_ops, register_op
from .rotary import apply_rotary, rotary_cos_sin, rotary_table
from .selection import KernelEnvironment, refusal
from .ssd import ssd_chunk_scan, ssd_step

BACKENDS = ("auto", "torch", "cuda")
BACKEND_ENV_VAR = "ORYX_KERNEL_BACKEND"


class Kernels:
    """One implementation per registered op, as its attribute (``kernels.ssd_step(...)``), and ``names``:
    op -> implementation name. Read-only."""

    def __init__(self, implementations: Dict[str, Callable], names: Dict[str, str]):
        self.__dict__.update(implementations, names=names)

    def __getattr__(self, op: str):  # only for names that are not attributes: an op nobody registered
        names = self.__dict__.get("names")
        if names is None or op.startswith("_"):  # copying and pickling look for hooks on an empty instance
            raise AttributeError(op)
        raise AttributeError(f"no kernel op {op!r}: the registered ops are {', '.join(names)} "
                             f"(declare one with oryx_megatron.ops.register_op)")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"Kernels is read-only: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Kernels is read-only: cannot delete {name!r}")


logger = logging.getLogger(__name__)


def get_kernels(backend: str = "auto", env: Optional[KernelEnvironment] = None,
                probe: Optional[Callable[[str], Optional[str]]] = None) -> Kernels:
    """Kernels of every registered op (``registry.OPS``) for a backend: "torch" (pure PyTorch), "cuda" (the CUDA
    kernels; RuntimeError naming each op whose kernel is missing, known broken or fails its check; an op that
    declares none runs its torch op, logged on a CUDA machine), or "auto": the value of $ORYX_KERNEL_BACKEND when set, otherwise per op the CUDA kernel where it may
    run (``refusal``) and passes its one-time check against the torch op (``probe``, on CUDA), else
    the torch op, with the reason logged.

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
        return Kernels({name: op.torch for name, op in OPS.items()}, {name: "torch" for name in OPS})
    return _select(backend, env or KernelEnvironment.detect(), probe or _probe_on_cuda, tuple(OPS.values()))


@functools.lru_cache(maxsize=None)
def _select(backend: str, env: KernelEnvironment, probe, registered: Tuple[KernelOp, ...]) -> Kernels:
    """Per op of ``registered`` (the registry's state: an op registered later is a new key) the CUDA kernel;
    where only its backward is refused (or fails its check), the kernel for calls that need no gradient and the
    torch op for the others; else the torch op. Once per process, environment and registry, with the reason
    logged."""
    chosen, names, refused = {}, {}, {}  # op -> function; op -> implementation name; op -> (why not, backward only)
    for declared in registered:
        op = declared.name
        if declared.cuda is None:  # torch by its declaration: named and logged, not a refusal of backend 'cuda'
            chosen[op], names[op] = declared.torch, "torch"
            if env.cuda:
                logger.warning("%s: the torch op runs: no CUDA kernel is declared for it (in %s)", op,
                               declared.torch.__module__)
            continue
        reason = refusal(op, env) or probe(op)
        if reason is None:
            chosen[op], names[op] = declared.cuda, declared.implementation
        elif refusal(op, env, backward=False) is None and probe(op, backward=False) is None:
            chosen[op] = _without_grad(declared.cuda, declared.torch)
            names[op] = f"{declared.implementation} without grad"
            refused[op] = (reason, True)
        else:
            chosen[op], names[op], refused[op] = declared.torch, "torch", (reason, False)
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
    return Kernels(chosen, names)


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
    return probe_kernel(op, OPS[op].cuda, OPS[op].torch, backward=backward)


__all__ = [
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "BlockReads",
    "Documents",
    "Kernels",
    "KernelOp",
    "OPS",
    "cuda_ops",
    "get_kernels",
    "register_op",
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
    "cast",
    "compute_dtype",
    "kv_gate",
]
