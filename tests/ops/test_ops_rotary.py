"""Rotary embedding: convention, position shift, norm and relative-position properties."""

import math

import torch

from oryx_megatron.ops import apply_rotary, rotary_cos_sin, rotary_table

DIM = 8


def test_rotate_half_convention():
    """Pairs (i, i + dim/2) rotate by position * base ** (-2i / dim)."""
    cos, sin = rotary_cos_sin(torch.tensor([3]), DIM, base=100.0, dtype=torch.float64)
    x = torch.zeros(1, 1, 1, DIM, dtype=torch.float64)
    x[..., 1] = 1.0
    angle = 3 * 100.0 ** (-2 / DIM)
    expected = torch.zeros(DIM, dtype=torch.float64)
    expected[1], expected[1 + DIM // 2] = math.cos(angle), math.sin(angle)
    assert (apply_rotary(x, cos, sin)[0, 0, 0] - expected).abs().max() < 1e-12
    cos0, sin0 = rotary_cos_sin(torch.tensor([0]), DIM, dtype=torch.float64)
    assert torch.equal(apply_rotary(x, cos0, sin0), x)


def test_offset_positions_equal_slice_of_longer_rotation():
    offset, s = 5, 6
    x = torch.randn(2, s, 3, DIM)
    cos, sin = rotary_cos_sin(torch.arange(offset, offset + s), DIM)
    cos_long, sin_long = rotary_cos_sin(torch.arange(offset + s), DIM)
    assert cos.shape == (s, DIM) and cos.dtype == torch.float32
    assert torch.equal(cos, cos_long[offset:]) and torch.equal(sin, sin_long[offset:])
    assert torch.equal(apply_rotary(x, cos, sin), apply_rotary(x, cos_long[offset:], sin_long[offset:]))


def test_preserves_norm_and_depends_on_relative_position():
    x = torch.randn(2, 6, 3, DIM, dtype=torch.float64)
    y = torch.randn(2, 6, 3, DIM, dtype=torch.float64)
    cos, sin = rotary_cos_sin(torch.arange(6), DIM, dtype=torch.float64)
    rx = apply_rotary(x, cos, sin)
    assert (rx.norm(dim=-1) - x.norm(dim=-1)).abs().max() < 1e-12
    # <R(m) x, R(n) y> depends on m - n only: shift both positions by 10
    cos2, sin2 = rotary_cos_sin(torch.arange(10, 16), DIM, dtype=torch.float64)
    dots = (rx[:, :3] * apply_rotary(y, cos, sin)[:, 3:]).sum(-1)
    dots2 = (apply_rotary(x, cos2, sin2)[:, :3] * apply_rotary(y, cos2, sin2)[:, 3:]).sum(-1)
    assert (dots - dots2).abs().max() < 1e-10


def test_computes_in_input_dtype():
    cos, sin = rotary_cos_sin(torch.arange(4), DIM)
    assert apply_rotary(torch.randn(1, 4, 2, DIM, dtype=torch.bfloat16), cos, sin).dtype == torch.bfloat16


def test_the_table_is_shared_and_covers_a_power_of_two_of_positions():
    cos, sin = rotary_table(300, DIM, 10000.0, torch.device("cpu"), torch.float64)
    assert cos.shape == (512, DIM)
    assert rotary_table(300, DIM, 10000.0, torch.device("cpu"), torch.float64)[0] is cos  # computed once
    want_cos, want_sin = rotary_cos_sin(torch.arange(512), DIM, dtype=torch.float64)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rotary_table(1, DIM, 10000.0, torch.device("cpu"), torch.float64)[0].shape == (1, DIM)


def test_a_table_first_built_in_inference_mode_serves_training():
    with torch.inference_mode():
        cos, sin = rotary_table(16, DIM, 500.0, torch.device("cpu"), torch.float32)
    x = torch.randn(1, 16, 2, DIM, requires_grad=True)
    apply_rotary(x, cos[:16], sin[:16]).square().sum().backward()  # an inference tensor would refuse
    assert x.grad is not None and not cos.is_inference()



def test_every_length_of_a_power_of_two_reads_one_table_for_good():
    """A captured decode graph reads the table by address: speculative verify forwards of ever new
    lengths must never free it (an LRU keyed by length evicted it after 16 lengths)."""
    table = rotary_table(513, DIM, 10000.0, torch.device("cpu"), torch.float64)
    for length in range(514, 1025):  # 511 more lengths, all within the table of 1024 positions
        assert rotary_table(length, DIM, 10000.0, torch.device("cpu"), torch.float64)[0] is table[0]
    for length in (2, 3, 5, 9, 17, 33, 65, 129, 257):  # other powers of two
        rotary_table(length, DIM, 10000.0, torch.device("cpu"), torch.float64)
    assert rotary_table(700, DIM, 10000.0, torch.device("cpu"), torch.float64)[0] is table[0]
