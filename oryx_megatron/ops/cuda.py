"""CUDA kernels behind the signatures of the pure-torch ops: flash-linear-attention (gated delta
rule), mamba-ssm (SSD, and the fused per-head gated RMSNorm), causal-conv1d (short conv), torch SDPA
(attention; torch picks the flash backend on CUDA) and torch FlexAttention (attention over the
query blocks that read it).

The libraries are imported inside the functions, so this module imports anywhere; which kernels may
run here is decided by ``selection``. Inputs a kernel does not take (CPU tensors, fp64; fp32 for fla's chunked kernel) run the torch op instead, so the
numbers never depend on where a tensor happens to live.
"""

import functools
from typing import Tuple

import torch

from . import attention, conv, gated_delta_rule, norm, ssd
from .memo import once_per_tensor

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

causal_attention = attention.causal_attention  # the same SDPA call on every device


def _kernel_takes(x: torch.Tensor, dtypes: Tuple[torch.dtype, ...] = _KERNEL_DTYPES) -> bool:
    return x.is_cuda and x.dtype in dtypes


def causal_conv1d(x, weight, bias=None, initial_state=None, activation="silu"):
    """causal-conv1d's `causal_conv1d_fn`; shapes as `conv.causal_conv1d` (x [b, s, c])."""
    if not _kernel_takes(x):
        return conv.causal_conv1d(x, weight, bias, initial_state, activation)
    from causal_conv1d import causal_conv1d_fn

    # states in and out need channel-last [b, c, s] inputs (stride(1) == 1): views of [b, s, c]
    if initial_state is not None:
        initial_state = initial_state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # [b, c, w-1]
    y, final_state = causal_conv1d_fn(
        x.contiguous().transpose(1, 2),  # [b, c, s]
        weight,
        bias,
        initial_states=initial_state,
        return_final_states=True,
        activation=activation,
    )  # y [b, c, s], final_state [b, c, w - 1]
    return y.transpose(1, 2), final_state


def causal_conv1d_step(x, state, weight, bias=None, activation="silu"):
    """causal-conv1d's `causal_conv1d_update`; shapes as `conv.causal_conv1d_step` (x [b, c])."""
    if not _kernel_takes(x):
        return conv.causal_conv1d_step(x, state, weight, bias, activation)
    from causal_conv1d import causal_conv1d_update

    new_state = state.to(x.dtype, copy=True, memory_format=torch.contiguous_format)  # updated in place
    y = causal_conv1d_update(x, new_state, weight, bias, activation)  # [b, c]
    return y, new_state


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, chunk_size=64
):
    """fla's `chunk_gated_delta_rule` (fp16/bf16 only; it uses its own chunk size of 64);
    shapes as `gated_delta_rule.chunk_gated_delta_rule`."""
    if not _kernel_takes(q, (torch.float16, torch.bfloat16)):
        return gated_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size
        )
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    o, final_state = fla_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
    )  # o [b, s, h, d_v], final_state [b, h, d_k, d_v] fp32
    return o.to(v.dtype), final_state


def gated_delta_rule_step(q, k, v, g, beta, state, scale=None):
    """fla's `fused_recurrent_gated_delta_rule` on one token; shapes as
    `gated_delta_rule.gated_delta_rule_step` (q [b, h, d_k])."""
    if not _kernel_takes(q):
        return gated_delta_rule.gated_delta_rule_step(q, k, v, g, beta, state, scale)
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    o, new_state = fused_recurrent_gated_delta_rule(
        q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],  # [b, 1, h, ...]
        scale=scale, initial_state=state, output_final_state=True,
    )
    return o[:, 0].to(v.dtype), new_state


def ssd_chunk_scan(x, dt, A, B, C, D=None, initial_state=None, output_final_state=True, chunk_size=64):
    """mamba-ssm's `mamba_chunk_scan_combined` with ngroups = nheads; shapes as
    `ssd.ssd_chunk_scan` (states [b, h, n, p]; mamba's are [b, h, p, n])."""
    if not _kernel_takes(x):
        return ssd.ssd_chunk_scan(x, dt, A, B, C, D, initial_state, output_final_state, chunk_size)
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    if initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()  # [b, h, p, n]
    out = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, return_final_states=output_final_state
    )
    if not output_final_state:
        return out, None
    y, final_state = out  # [b, s, h, p], [b, h, p, n] fp32
    return y, final_state.transpose(-1, -2)


def ssd_step(x, dt, A, B, C, state, D=None):
    """mamba-ssm's `selective_state_update` (per-head dt, A, D broadcast over head_dim); shapes as
    `ssd.ssd_step` (state [b, h, n, p])."""
    if not _kernel_takes(x):
        return ssd.ssd_step(x, dt, A, B, C, state, D)
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update

    h, p, n = x.shape[1], x.shape[-1], B.shape[-1]
    new_state = state.transpose(-1, -2).clone(memory_format=torch.contiguous_format)  # [b, h, p, n], in place
    y = selective_state_update(
        new_state,
        x,  # [b, h, p]
        dt[..., None].expand(-1, -1, p),  # [b, h, p], already softplus-ed
        A[:, None, None].expand(-1, p, n),  # [h, p, n]
        B,  # [b, h, n]  (ngroups = nheads)
        C,
        D=None if D is None else D[:, None].expand(-1, p),  # [h, p]
        dt_bias=dt.new_zeros(h, p),  # mamba-ssm 2.3.2 reads dt_bias.stride() even when it is None
        dt_softplus=False,
    )  # [b, h, p]
    return y, new_state.transpose(-1, -2)


def block_sparse_causal_attention(q, k, v, read, block_size=128, scale=None):
    """torch's FlexAttention (compiled) with a block mask from ``read``: query blocks with no reading
    position are skipped by the kernel; shapes as `attention.block_sparse_causal_attention`."""
    if not _kernel_takes(q):
        return attention.block_sparse_causal_attention(q, k, v, read, block_size, scale)
    o = _compiled_flex_attention()(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, h, s, d]
        block_mask=read_block_mask(read, k.shape[1], block_size), scale=scale,
    )  # [b, h, sq, d_v]
    return o.transpose(1, 2)


@once_per_tensor
def read_block_mask(read, kv_len: int, block_size: int):
    """FlexAttention's BlockMask: query i (the last read.shape[1] of kv_len positions) sees keys up to
    its own position where read[b, i], nothing elsewhere. Built once per ``read`` tensor (the layers
    of a forward share one)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, sq = read.shape
    offset = kv_len - sq

    def reads_causally(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & read[batch, q_idx]

    return create_block_mask(reads_causally, b, None, sq, kv_len, device=read.device, BLOCK_SIZE=block_size)


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def gated_rms_norm(y, gate, weight, eps=1e-5):
    """mamba-ssm's fused `rmsnorm_fn` (one Triton kernel forward, one backward) with a group per
    head; shapes as `norm.gated_rms_norm`."""
    if not _kernel_takes(y):
        return norm.gated_rms_norm(y, gate, weight, eps)
    from mamba_ssm.ops.triton.layernorm_gated import rmsnorm_fn

    *lead, h, d = y.shape
    o = rmsnorm_fn(y.reshape(-1, h * d), weight, None, z=gate.reshape(-1, h * d), eps=eps, group_size=d,
                   norm_before_gate=True)  # [b * s, h * d]
    return o.view(*lead, h, d)
