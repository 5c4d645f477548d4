"""Backend selection (`get_kernels`) and the CUDA wrappers' torch fallback on CPU tensors."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron import ops
from oryx_megatron.ops import BACKEND_ENV_VAR, Kernels, cuda, get_kernels

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_torch_backend_is_all_torch(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "cuda")  # an explicit backend ignores the variable
    kernels = get_kernels("torch")
    assert set(kernels.names) == set(ops.OPS) and set(kernels.names.values()) == {"torch"}
    for op in ops.OPS:
        assert getattr(kernels, op) is getattr(ops, op)


@no_cuda
def test_auto_on_cpu_machine_is_torch(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV_VAR, raising=False)
    assert set(get_kernels().names.values()) == {"torch"}
    assert set(get_kernels("auto").names.values()) == {"torch"}


def test_env_var_is_honoured(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV_VAR, "torch")
    assert set(get_kernels().names.values()) == {"torch"}
    monkeypatch.setenv(BACKEND_ENV_VAR, "tpu")
    with pytest.raises(ValueError, match=f"'tpu'.*{BACKEND_ENV_VAR}"):
        get_kernels()


def test_unknown_backend_raises_value_error():
    with pytest.raises(ValueError, match="'triton'.*auto, torch, cuda"):
        get_kernels("triton")


@no_cuda
def test_cuda_backend_without_cuda_raises_clearly():
    with pytest.raises(RuntimeError, match="CUDA is not available") as info:
        get_kernels("cuda")
    assert "chunk_gated_delta_rule" in str(info.value)
    assert cuda.unavailable("ssd_chunk_scan") == "CUDA is not available"


def test_kernels_is_frozen_and_complete():
    kernels = get_kernels("torch")
    assert isinstance(kernels, Kernels) and len(ops.OPS) == 7
    with pytest.raises(dataclasses.FrozenInstanceError):
        kernels.ssd_step = None


def test_cuda_wrappers_fall_back_to_torch_on_cpu_tensors():
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    b, s, h, d = 2, 9, 2, 4
    q, k = (F.normalize(rand(b, s, h, d), dim=-1) for _ in range(2))
    v, g, beta, state = rand(b, s, h, d), -rand(b, s, h).abs(), rand(b, s, h).sigmoid(), rand(b, h, d, d)
    x, weight, bias, conv_state = rand(b, s, 3), rand(3, 4), rand(3), rand(b, 3, 3)
    dt, A, D = rand(b, s, h).exp(), -rand(h).exp(), rand(h)
    calls = {
        "chunk_gated_delta_rule": (q, k, v, g, beta, None, state, True, 4),
        "gated_delta_rule_step": (q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state),
        "ssd_chunk_scan": (v, dt, A, k, q, D, state, True, 4),
        "ssd_step": (v[:, 0], dt[:, 0], A, k[:, 0], q[:, 0], state, D),
        "causal_conv1d": (x, weight, bias, conv_state),
        "causal_conv1d_step": (x[:, 0], conv_state, weight, bias),
        "causal_attention": (q, k, v),
    }
    for op, args in calls.items():
        got, want = getattr(cuda, op)(*args), getattr(ops, op)(*args)
        for a, b_ in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
            assert torch.equal(a, b_), op
