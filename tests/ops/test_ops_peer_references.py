"""Against the peer libraries' own reference implementations, when they are installed."""

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron.ops import chunk_gated_delta_rule, ssd_chunk_scan


def test_gated_delta_rule_matches_fla_naive():
    naive = pytest.importorskip("fla.ops.gated_delta_rule.naive")
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    b, s, h, dk, dv = 2, 37, 3, 8, 6
    q, k = (F.normalize(rand(b, s, h, dk), dim=-1) for _ in range(2))
    v, h0 = rand(b, s, h, dv), rand(b, h, dk, dv)
    g, beta = F.logsigmoid(rand(b, s, h)), rand(b, s, h).sigmoid()
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, chunk_size=16)

    # argument order q, k, v, beta, g; older fla versions take [b, h, s, d] ("head first")
    time_major = "[B, T, H, K]" in (naive.naive_recurrent_gated_delta_rule.__doc__ or "")
    layout = (lambda t: t) if time_major else (lambda t: t.transpose(1, 2))
    o_ref, state_ref = naive.naive_recurrent_gated_delta_rule(
        *(layout(t) for t in (q, k, v, beta, g)), initial_state=h0, output_final_state=True
    )
    assert (o - layout(o_ref)).abs().max() < 1e-4
    assert (state - state_ref).abs().max() < 1e-4


def test_ssd_matches_mamba_minimal():
    """ssd_minimal_discrete takes shared B/C groups; with one head per call it is our per-head SSD."""
    minimal = pytest.importorskip("mamba_ssm.modules.ssd_minimal")
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    b, s, h, p, n, chunk = 2, 32, 3, 4, 5, 8
    x, dt, A = rand(b, s, h, p), F.softplus(rand(b, s, h)), -rand(h).exp()
    B, C, h0 = rand(b, s, h, n), rand(b, s, h, n), rand(b, h, n, p)
    y, state = ssd_chunk_scan(x, dt, A, B, C, initial_state=h0, chunk_size=chunk)
    for i in range(h):
        one = slice(i, i + 1)
        y_ref, state_ref = minimal.ssd_minimal_discrete(
            x[:, :, one] * dt[:, :, one, None], A[one] * dt[:, :, one], B[:, :, one], C[:, :, one], chunk,
            initial_states=h0[:, None, None, one].transpose(-1, -2),  # [b, 1, 1, 1, p, n]
        )
        assert (y[:, :, one] - y_ref).abs().max() < 1e-9
        assert (state[:, i] - state_ref[:, 0, 0].transpose(-1, -2)).abs().max() < 1e-9
