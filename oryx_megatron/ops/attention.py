"""Causal softmax attention via torch's scaled_dot_product_attention (flash / efficient / math
backend chosen by torch), with the queries aligned to the end of the key sequence."""

from typing import Optional

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None
) -> torch.Tensor:
    """Causal attention where the queries are the last sq positions of the key sequence.

    Args:
        q: [b, sq, h, d_k]; k: [b, sk, h, d_k]; v: [b, sk, h, d_v] with sk >= sq.
        scale: default d_k ** -0.5.
    Returns:
        o [b, sq, h, d_v]; query i sees keys j <= sk - sq + i (bottom-right aligned mask).
    """
    sq, sk = q.shape[1], k.shape[1]
    if sq > sk:
        raise ValueError(f"causal_attention needs sk >= sq, got sq={sq}, sk={sk}")
    mask = None  # sq == sk: is_causal; sq == 1: the last query sees every key
    if 1 < sq < sk:
        mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)  # [sq, sk]
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, h, s, d]
        attn_mask=mask, is_causal=sq == sk, scale=scale,
    )  # [b, h, sq, d_v]
    return o.transpose(1, 2)
