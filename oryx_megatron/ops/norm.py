"""The per-head gated RMSNorm of a mixer's output (the reference of mamba-ssm's fused kernel)."""

import torch
import torch.nn.functional as F
from torch import Tensor

from .chunking import cast, compute_dtype


def upcast(x: Tensor) -> Tensor:
    """x in fp32, or in its own dtype when that is wider (fp64 tests)."""
    return cast(x, compute_dtype(x))


def gated_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over each head's channels, times the weight, times the SiLU gate.

    Args:
        y, gate: [..., h, d]; weight: [h * d].
    Returns:
        [..., h, d] in y's dtype, computed in fp32 (or wider):
        y / sqrt(mean_d(y^2) + eps) * weight * silu(gate).
    """
    y32 = F.rms_norm(upcast(y), y.shape[-1:], eps=eps)  # one fused op (the weight is per head, not per channel)
    return cast(y32 * upcast(weight).view(y.shape[-2:]) * F.silu(upcast(gate)), y.dtype)


def kv_gate(x: Tensor, gate_input: Tensor, kind: str) -> Tensor:
    """x * gate(gate_input) in fp32 (or wider), in x's dtype: the multiplicative gate of the shared keys
    and values (``kv_gate``: "sigmoid" or "silu")."""
    gate = torch.sigmoid if kind == "sigmoid" else F.silu
    return cast(upcast(x) * gate(upcast(gate_input)), x.dtype)
