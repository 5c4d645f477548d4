"""Causal depthwise short conv: prefill == steps, carried state, and nn.functional.conv1d."""

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron.ops import causal_conv1d, causal_conv1d_step

B, C, W = 2, 5, 4


def make_inputs(s, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return rand(B, s, C), rand(C, W), rand(C), rand(B, C, W - 1)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("with_state", [False, True])
def test_prefill_equals_step_loop(activation, with_state):
    x, weight, bias, h0 = make_inputs(9)
    initial_state = h0 if with_state else None
    y, state = causal_conv1d(x, weight, bias, initial_state, activation)

    step_state = h0 if with_state else torch.zeros(B, C, W - 1, dtype=x.dtype)
    ys = []
    for t in range(x.shape[1]):
        y_t, step_state = causal_conv1d_step(x[:, t], step_state, weight, bias, activation)
        ys.append(y_t)
    assert y.shape == x.shape and state.shape == (B, C, W - 1)
    assert (y - torch.stack(ys, dim=1)).abs().max() < 1e-12
    assert torch.equal(state, step_state)


def test_equals_conv1d_with_left_zero_padding():
    x, weight, bias, _ = make_inputs(9)
    y, _ = causal_conv1d(x, weight, bias, activation=None)
    ref = F.conv1d(F.pad(x.transpose(1, 2), (W - 1, 0)), weight[:, None], bias, groups=C).transpose(1, 2)
    assert (y - ref).abs().max() < 1e-12
    y_silu, _ = causal_conv1d(x, weight, bias)
    assert (y_silu - F.silu(ref)).abs().max() < 1e-12


def test_final_state_when_shorter_than_window():
    x, weight, bias, h0 = make_inputs(2)
    _, state = causal_conv1d(x, weight, bias, h0)
    assert torch.equal(state, torch.cat([h0[..., 2:], x.transpose(1, 2)], dim=-1))
    _, state = causal_conv1d(x, weight, bias)
    assert torch.equal(state, torch.cat([torch.zeros(B, C, 1, dtype=x.dtype), x.transpose(1, 2)], dim=-1))


@pytest.mark.parametrize("split", [1, 2, 6])
def test_split_with_carried_state_equals_one_call(split):
    x, weight, bias, h0 = make_inputs(9)
    y, state = causal_conv1d(x, weight, bias, h0)
    y1, state1 = causal_conv1d(x[:, :split], weight, bias, h0)
    y2, state2 = causal_conv1d(x[:, split:], weight, bias, state1)
    assert (torch.cat([y1, y2], dim=1) - y).abs().max() < 1e-12
    assert torch.equal(state2, state)


def test_low_precision_input_keeps_dtype():
    x, weight, bias, h0 = make_inputs(9)
    y, state = causal_conv1d(x.bfloat16(), weight.float(), bias.float(), h0.bfloat16())
    y_t, state_t = causal_conv1d_step(x[:, 0].bfloat16(), h0.bfloat16(), weight.float(), bias.float())
    assert y.dtype == state.dtype == y_t.dtype == state_t.dtype == torch.bfloat16
    y_ref, _ = causal_conv1d(x.bfloat16().double(), weight, bias, h0.bfloat16().double())
    assert (y.double() - y_ref).abs().max() < 0.05


def test_rejects_unknown_activation():
    x, weight, bias, _ = make_inputs(3)
    with pytest.raises(ValueError, match="gelu"):
        causal_conv1d(x, weight, bias, activation="gelu")
