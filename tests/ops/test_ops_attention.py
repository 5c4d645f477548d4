"""Causal SDPA attention == an explicit masked softmax, bottom-right aligned."""

import pytest
import torch

from oryx_megatron.ops import causal_attention

B, H, DK, DV = 2, 3, 4, 5


def make_qkv(sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return rand(B, sq, H, DK), rand(B, sk, H, DK), rand(B, sk, H, DV)


def reference(q, k, v, scale=None):
    sq, sk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)  # [sq, sk]
    probs = scores.masked_fill(~visible, -torch.inf).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 7), (1, 7), (1, 1)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_matches_masked_softmax_fp64(sq, sk, scale):
    q, k, v = make_qkv(sq, sk)
    o = causal_attention(q, k, v, scale=scale)
    assert o.shape == (B, sq, H, DV) and o.dtype == torch.float64
    assert (o - reference(q, k, v, scale)).abs().max() < 1e-12


def test_queries_are_the_last_positions():
    q, k, v = make_qkv(7, 7)
    full = causal_attention(q, k, v)
    assert (causal_attention(q[:, -1:], k, v) - full[:, -1:]).abs().max() < 1e-12
    assert (causal_attention(q[:, -3:], k, v) - full[:, -3:]).abs().max() < 1e-12
