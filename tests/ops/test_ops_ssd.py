"""Chunked SSD scan == a Python loop of the single-token step (the naive recurrence)."""

import pytest
import torch
import torch.nn.functional as F

from tests.ops.equivalence import assert_same_values_and_grads
from oryx_megatron.ops import ssd_chunk_scan, ssd_step

B, H, P, N = 2, 3, 4, 5


def make_inputs(s, dtype=torch.float64, seed=0, dt_shift=0.0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(
        x=rand(B, s, H, P).to(dtype),
        dt=F.softplus(rand(B, s, H) + dt_shift).to(dtype),
        A=-torch.exp(rand(H)).to(dtype),
        B=rand(B, s, H, N).to(dtype),
        C=rand(B, s, H, N).to(dtype),
        D=rand(H).to(dtype),
    ), rand(B, H, N, P).to(dtype)


def loop_steps(x, dt, A, B, C, D=None, initial_state=None):
    state = torch.zeros(x.shape[0], H, N, P, dtype=torch.float64) if initial_state is None else initial_state
    outs = []
    for t in range(x.shape[1]):
        y, state = ssd_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], state, D=D)
        outs.append(y)
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("s,chunk_size", [(37, 16), (64, 16), (1, 16), (5, 64)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_step_loop_fp64_with_grads(s, chunk_size, with_state):
    inputs, h0 = make_inputs(s)
    leaves = {**inputs, **({"initial_state": h0} if with_state else {})}
    leaves = {name: t.clone().requires_grad_() for name, t in leaves.items()}
    y, state = ssd_chunk_scan(**leaves, chunk_size=chunk_size)
    y_ref, state_ref = loop_steps(**leaves)

    assert y.shape == (B, s, H, P) and state.shape == (B, H, N, P)
    grads_ref = assert_same_values_and_grads((y, state), (y_ref, state_ref), leaves)
    assert all(grads_ref[name].abs().max() > 0 for name in ("x", "dt", "B", "C", "D"))


def test_without_skip_and_final_state():
    inputs, h0 = make_inputs(21)
    inputs["D"] = None
    y, state = ssd_chunk_scan(**inputs, initial_state=h0, output_final_state=False, chunk_size=8)
    y_ref, _ = loop_steps(**inputs, initial_state=h0)
    assert state is None
    assert (y - y_ref).abs().max() < 1e-9


@pytest.mark.parametrize("split", [20, 16])
def test_split_with_carried_state_equals_one_call(split):
    inputs, h0 = make_inputs(37)
    y, state = ssd_chunk_scan(**inputs, initial_state=h0, chunk_size=16)
    per_token = ("x", "dt", "B", "C")
    first = {name: t[:, :split] if name in per_token else t for name, t in inputs.items()}
    second = {name: t[:, split:] if name in per_token else t for name, t in inputs.items()}
    y1, state1 = ssd_chunk_scan(**first, initial_state=h0, chunk_size=16)
    y2, state2 = ssd_chunk_scan(**second, initial_state=state1, chunk_size=16)
    assert (torch.cat([y1, y2], dim=1) - y).abs().max() < 1e-12
    assert (state2 - state).abs().max() < 1e-12


def test_fp32_matches_step_and_keeps_dtype():
    inputs, h0 = make_inputs(37, dtype=torch.float32)
    y, state = ssd_chunk_scan(**inputs, initial_state=h0, chunk_size=16)
    y_ref, state_ref = loop_steps(**inputs, initial_state=h0)
    assert y.dtype == torch.float32 and state.dtype == torch.float32 and y_ref.dtype == torch.float32
    assert (y - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    assert (state - state_ref).abs().max() < 1e-5 * state_ref.abs().max()


def test_strong_decay_stays_finite_fp32():
    """Large dt (cumulative log-decays of -1000s across chunks) must not overflow."""
    inputs, h0 = make_inputs(64, dtype=torch.float32, dt_shift=30.0)
    leaves = {name: t.clone().requires_grad_() for name, t in {**inputs, "initial_state": h0}.items()}
    y, state = ssd_chunk_scan(**leaves, chunk_size=16)
    y_ref, state_ref = loop_steps(**leaves)
    assert (y - y_ref).abs().max() < 1e-5 * y_ref.abs().max()
    assert (state - state_ref).abs().max() < 1e-5 * state_ref.abs().max()
    grads = torch.autograd.grad(y.sum() + state.sum(), list(leaves.values()))
    assert all(torch.isfinite(grad).all() for grad in grads)


def test_bf16_inputs_give_bf16_output_and_fp32_state():
    inputs, h0 = make_inputs(37)
    y_ref, state_ref = ssd_chunk_scan(**inputs, initial_state=h0, chunk_size=16)
    low = {name: t.to(torch.bfloat16) if name in ("x", "B", "C") else t.float() for name, t in inputs.items()}
    y, state = ssd_chunk_scan(**low, initial_state=h0.float(), chunk_size=16)
    x, dt, A, B_, C, D = low.values()
    y_step, state_step = ssd_step(x[:, 0], dt[:, 0], A, B_[:, 0], C[:, 0], h0.float(), D=D)
    assert y.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert y_step.dtype == torch.bfloat16 and state_step.dtype == torch.float32
    assert (y.double() - y_ref).abs().max() < 0.02 * y_ref.abs().max()
    assert (state.double() - state_ref).abs().max() < 0.02 * state_ref.abs().max()


def quadratic_form(x, dt, A, B, C, D, initial_state):
    """An oracle written from the SSD paper's quadratic ("attention") form, not from the module: with the decay
    L[t, j] = exp(A sum_{j < i <= t} dt_i) for j <= t, y_t = sum_j (C_t . B_j) L[t, j] dt_j x_j
    + C_t^T exp(A sum_{i <= t} dt_i) S_0 + D x_t; the final state sum_j L[s-1, j] dt_j B_j x_j^T + L0 S_0."""
    cum = torch.cumsum(dt * A, dim=1)  # [b, s, h]: A sum_{i <= t} dt_i
    s = x.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    L = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~causal[None, :, :, None], -torch.inf))  # b t j h
    scores = torch.einsum("bthn,bjhn->btjh", C, B) * L * dt[:, None]  # [b, t, j, h]
    y = torch.einsum("btjh,bjhp->bthp", scores, x)
    y = y + torch.einsum("bthn,bhnp->bthp", C * torch.exp(cum)[..., None], initial_state) + D[:, None] * x
    last = torch.exp(cum[:, -1:] - cum) * dt  # [b, j, h]: the decay of write j to the end, times dt_j
    final = torch.einsum("bjh,bjhn,bjhp->bhnp", last, B, x) + torch.exp(cum[:, -1])[..., None, None] * initial_state
    return y, final


def test_chunked_equals_the_quadratic_form():
    inputs, h0 = make_inputs(29)
    y, state = ssd_chunk_scan(**inputs, initial_state=h0, chunk_size=8)
    y_ref, state_ref = quadratic_form(**inputs, initial_state=h0)
    assert (y - y_ref).abs().max() < 1e-10 and (state - state_ref).abs().max() < 1e-10
