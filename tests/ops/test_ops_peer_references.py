"""Against the peer libraries' own reference implementations: fla's naive gated delta rule and mamba-ssm's
ssd_minimal, independent oracles of the chunked scans. Skipped in the main venv (neither library is there);
`make test-kernels` runs them in its venv, which has both, with ORYX_PEER_REFERENCES=required: a missing
library is then an error, not a skip."""

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron.ops import chunk_gated_delta_rule, ssd_chunk_scan


def peer(module: str):
    """The peer library's module, or a skip where it is not installed (unless required)."""
    if os.environ.get("ORYX_PEER_REFERENCES") == "required":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def test_gated_delta_rule_matches_fla_naive():
    naive = peer("fla.ops.gated_delta_rule.naive")
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
    """ssd_minimal_discrete (the SSD paper's Listing 1) takes the discretized inputs x dt and A dt, per-head B
    and C [b, l, h, n], and states [b, h, p, n]: ours [b, h, n, p], transposed."""
    minimal = peer("mamba_ssm.modules.ssd_minimal")
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    b, s, h, p, n, chunk = 2, 32, 3, 4, 5, 8
    x, dt, A = rand(b, s, h, p), F.softplus(rand(b, s, h)), -rand(h).exp()
    B, C, h0 = rand(b, s, h, n), rand(b, s, h, n), rand(b, h, n, p)
    y, state = ssd_chunk_scan(x, dt, A, B, C, initial_state=h0, chunk_size=chunk)
    y_ref, state_ref = minimal.ssd_minimal_discrete(x * dt[..., None], A * dt, B, C, chunk,
                                                    initial_states=h0.transpose(-1, -2)[:, None])  # [b, 1, h, p, n]
    assert (y - y_ref).abs().max() < 1e-9
    assert (state - state_ref.transpose(-1, -2)).abs().max() < 1e-9
