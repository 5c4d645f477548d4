"""Norms: the layer RMSNorm (local backend) and the per-head gated RMSNorm of the mixer output."""

import torch
import torch.nn.functional as F
from torch import Tensor

from oryx_megatron.config import OryxConfig


def upcast(x: Tensor) -> Tensor:
    """x in fp32, or in its own dtype when that is wider (fp64 tests)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class RMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm with megatron's norm signature; sequence-parallel aware.

    Under sequence parallelism each TP rank sees a slice of the sequence, so the
    weight is flagged ``sequence_parallel`` and megatron all-reduces its grad over TP
    (megatron's ``WrappedTorchNorm`` refuses sequence parallelism instead).
    """

    def __init__(self, config: OryxConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def gated_head_rms_norm(y: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Per-head RMSNorm of the mixer output, then the SiLU output gate.

    y, gate: [..., h, d_v]; weight: [h * d_v]. Computed in fp32 (or wider); returns y's dtype.
    Normalising each head separately brings both mixers to one scale before the shared
    gate and output projection, and keeps tensor parallelism (heads split over ranks) exact.
    """
    y32 = upcast(y)
    y32 = y32 * torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + eps)
    y32 = y32 * upcast(weight).view(y.shape[-2], y.shape[-1]) * F.silu(upcast(gate))
    return y32.to(y.dtype)
