"""Chunked gated delta rule == a Python loop of the single-token step (the naive recurrence)."""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.equivalence import assert_same_values_and_grads
from oryx_megatron.ops import chunk_gated_delta_rule, gated_delta_rule_step

B, H, DK, DV = 2, 2, 4, 3


def make_inputs(s, dtype=torch.float64, seed=0, decay_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(
        q=F.normalize(rand(B, s, H, DK), dim=-1).to(dtype),
        k=F.normalize(rand(B, s, H, DK), dim=-1).to(dtype),
        v=rand(B, s, H, DV).to(dtype),
        g=(decay_scale * F.logsigmoid(rand(B, s, H))).to(dtype),
        beta=torch.sigmoid(rand(B, s, H)).to(dtype),
    ), rand(B, H, DK, DV).to(dtype)


def loop_steps(q, k, v, g, beta, initial_state=None, scale=None):
    state = torch.zeros(B, H, DK, DV, dtype=torch.float64) if initial_state is None else initial_state
    outs = []
    for t in range(q.shape[1]):
        o, state = gated_delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, scale=scale)
        outs.append(o)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("s,chunk_size", [(37, 16), (64, 16), (1, 16), (5, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_step_loop_fp64_with_grads(s, chunk_size, with_state):
    inputs, h0 = make_inputs(s)
    leaves = {**inputs, **({"initial_state": h0} if with_state else {})}
    leaves = {name: t.clone().requires_grad_() for name, t in leaves.items()}
    o, state = chunk_gated_delta_rule(**leaves, chunk_size=chunk_size)
    o_ref, state_ref = loop_steps(**leaves)

    assert o.shape == (B, s, H, DV) and state.shape == (B, H, DK, DV)
    grads_ref = assert_same_values_and_grads((o, state), (o_ref, state_ref), leaves)
    assert all(grads_ref[name].abs().max() > 0 for name in ("q", "k", "v", "beta"))


def test_custom_scale_and_no_final_state():
    inputs, h0 = make_inputs(21)
    o, state = chunk_gated_delta_rule(
        **inputs, scale=0.3, initial_state=h0, output_final_state=False, chunk_size=8
    )
    o_ref, _ = loop_steps(**inputs, initial_state=h0, scale=0.3)
    assert state is None
    assert (o - o_ref).abs().max() < 1e-9


@pytest.mark.parametrize("split", [20, 16])
def test_split_with_carried_state_equals_one_call(split):
    inputs, h0 = make_inputs(37)
    o, state = chunk_gated_delta_rule(**inputs, initial_state=h0, chunk_size=16)
    first = {name: t[:, :split] for name, t in inputs.items()}
    second = {name: t[:, split:] for name, t in inputs.items()}
    o1, state1 = chunk_gated_delta_rule(**first, initial_state=h0, chunk_size=16)
    o2, state2 = chunk_gated_delta_rule(**second, initial_state=state1, chunk_size=16)
    assert (torch.cat([o1, o2], dim=1) - o).abs().max() < 1e-12
    assert (state2 - state).abs().max() < 1e-12


def test_fp32_matches_step_and_keeps_dtype():
    inputs, h0 = make_inputs(37, dtype=torch.float32)
    o, state = chunk_gated_delta_rule(**inputs, initial_state=h0, chunk_size=16)
    o_ref, state_ref = loop_steps(**inputs, initial_state=h0)
    assert o.dtype == torch.float32 and state.dtype == torch.float32 and o_ref.dtype == torch.float32
    assert (o - o_ref).abs().max() < 1e-5
    assert (state - state_ref).abs().max() < 1e-5


def test_strong_decay_stays_finite_fp32():
    """Cumulative log-decays of -1000s inside a chunk must not overflow the masked exp."""
    inputs, h0 = make_inputs(64, dtype=torch.float32, decay_scale=40.0)
    leaves = {name: t.clone().requires_grad_() for name, t in {**inputs, "initial_state": h0}.items()}
    o, state = chunk_gated_delta_rule(**leaves, chunk_size=64)
    o_ref, state_ref = loop_steps(**leaves)
    assert (o - o_ref).abs().max() < 1e-5 and (state - state_ref).abs().max() < 1e-5
    grads = torch.autograd.grad(o.sum() + state.sum(), list(leaves.values()))
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    inputs, h0 = make_inputs(37)
    o_ref, state_ref = chunk_gated_delta_rule(**inputs, initial_state=h0, chunk_size=16)
    low = {name: t.to(torch.bfloat16) for name, t in inputs.items()}
    o, state = chunk_gated_delta_rule(**low, initial_state=h0.float(), chunk_size=16)
    o_step, state_step = gated_delta_rule_step(*(t[:, 0] for t in low.values()), h0.float())
    assert o.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert o_step.dtype == torch.bfloat16 and state_step.dtype == torch.float32
    assert (o.double() - o_ref).abs().max() < 0.1
    assert (state.double() - state_ref).abs().max() < 0.1


def design_card_recurrence(q, k, v, g, beta, initial_state):
    """An oracle written from docs/design.md, not from the module: per token and head, with the state as a
    [d_k, d_v] matrix, S_t = exp(g_t) (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T and o_t = S_t^T q_t / sqrt(d_k)."""
    eye = torch.eye(DK, dtype=torch.float64)
    out = torch.zeros(B, q.shape[1], H, DV, dtype=torch.float64)
    state = initial_state.clone()
    for b in range(B):
        for h in range(H):
            S = state[b, h]
            for t in range(q.shape[1]):
                kt, bt = k[b, t, h][:, None], beta[b, t, h]  # [d_k, 1]
                S = torch.exp(g[b, t, h]) * (eye - bt * kt @ kt.T) @ S + bt * kt @ v[b, t, h][None]
                out[b, t, h] = S.T @ q[b, t, h] / DK ** 0.5
            state[b, h] = S
    return out, state


def test_chunked_equals_the_design_cards_recurrence():
    inputs, h0 = make_inputs(29)
    o, state = chunk_gated_delta_rule(**inputs, initial_state=h0, chunk_size=8)
    o_ref, state_ref = design_card_recurrence(**inputs, initial_state=h0)
    assert (o - o_ref).abs().max() < 1e-10 and (state - state_ref).abs().max() < 1e-10
