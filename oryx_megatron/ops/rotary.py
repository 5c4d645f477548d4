"""Rotary position embedding, non-interleaved rotate-half convention (as Megatron / Llama)."""

import functools
from typing import Tuple

import torch

from .chunking import cast


def rotary_cos_sin(
    positions: torch.Tensor, dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles positions * base ** (-2i / dim), computed in fp64.

    Args:
        positions: [s] (long; any leading shape works, e.g. [b, s]); dim: even rotary dim.
    Returns:
        cos, sin: [s, dim] in dtype; both halves of the last dim repeat the dim / 2 frequencies.
    """
    inv_freq = base ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[..., None] * inv_freq  # [s, dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [s, dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotary_table(
    length: int, dim: int, base: float, device: torch.device, dtype: torch.dtype
) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n, dim] of positions 0 .. n - 1, n the power of two >= length: one table per
    (n, dim, base, device, dtype), shared by every layer and call that index it and kept for the
    life of the process (a captured CUDA graph reads it by address; powers of two bound the count)."""
    return _power_of_two_table(1 << max(length - 1, 0).bit_length(), dim, base, device, dtype)


@functools.lru_cache(maxsize=None)
def _power_of_two_table(n: int, dim: int, base: float, device: torch.device, dtype: torch.dtype):
    with torch.inference_mode(False), torch.no_grad():  # usable by autograd after an inference-mode first call
        return rotary_cos_sin(torch.arange(n, device=device), dim, base, dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [b, s, h, dim] by cos, sin [s, dim] (or [b, s, dim]), in x's dtype:
    x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1]."""
    cos, sin = (cast(t, x.dtype)[..., None, :] for t in (cos, sin))  # [s, 1, dim]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin
