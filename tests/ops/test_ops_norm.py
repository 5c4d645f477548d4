"""The per-head gated RMSNorm of the mixer output (the torch op; mamba-ssm's kernel is checked
against it by ``ops.probe.probe`` and the GPU check)."""

import torch
import torch.nn.functional as F

from oryx_megatron.ops import gated_rms_norm


def test_each_head_is_normalised_on_its_own_then_weighted_and_gated():
    b, s, h, d = 2, 3, 4, 8
    y, gate = torch.randn(b, s, h, d, dtype=torch.float64), torch.randn(b, s, h, d, dtype=torch.float64)
    weight = torch.randn(h * d, dtype=torch.float64)
    out = gated_rms_norm(y, gate, weight, eps=0.0)
    rms = y.pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(out, y / rms * weight.view(h, d) * F.silu(gate), rtol=1e-12, atol=1e-12)
    scaled = y.clone()
    scaled[:, :, 1] *= 100.0  # one head's scale does not reach the others, nor its own output
    torch.testing.assert_close(gated_rms_norm(scaled, gate, weight, eps=0.0), out, rtol=1e-12, atol=1e-12)


def test_computes_in_fp32_and_returns_the_input_dtype():
    y, gate = torch.randn(2, 5, 2, 16).to(torch.bfloat16), torch.randn(2, 5, 2, 16).to(torch.bfloat16)
    weight = torch.ones(32, dtype=torch.bfloat16)
    out = gated_rms_norm(y, gate, weight, eps=1e-5)
    assert out.dtype == torch.bfloat16
    want = gated_rms_norm(y.double(), gate.double(), weight.double(), eps=1e-5)
    assert (out.double() - want).abs().max() <= 2 ** -7 * want.abs().max()  # one bf16 rounding
