"""CUDA kernels behind the signatures of the pure-torch ops: flash-linear-attention (gated delta
rule), mamba-ssm (SSD, and the fused per-head gated RMSNorm), causal-conv1d (short conv), torch SDPA
(attention; torch picks the flash backend on CUDA) and torch FlexAttention (attention over the
query blocks that read it).

The libraries are imported on first use (``_kernel``), so this module imports anywhere; which kernels may
run here is decided by ``selection``. Inputs a kernel does not take (CPU tensors, fp64; fp32 for fla's chunked kernel) run the torch op instead, so the
numbers never depend on where a tensor happens to live.
"""

import functools
import importlib
from typing import Callable, Tuple

import torch
import torch.nn.functional as F

from . import attention, conv, gated_delta_rule, norm, ssd

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

causal_attention = attention.causal_attention  # the same SDPA call on every device


def _kernel(module: str, name: str) -> Callable:
    """A function of an optional kernel library (causal-conv1d, fla, mamba-ssm), imported on first use. No import
    statement names these libraries: transformers' remote-code check would require them of everyone who loads an
    exported folder (hf/remote_code.py), and ``selection`` picks a kernel only where its library imports."""
    return getattr(importlib.import_module(module), name)


def _kernel_takes(x: torch.Tensor, dtypes: Tuple[torch.dtype, ...] = _KERNEL_DTYPES) -> bool:
    return x.is_cuda and x.dtype in dtypes


def _conv_kernel_takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """causal-conv1d's channel-last kernels take widths 2-4 and channel counts divisible by 8."""
    return _kernel_takes(x) and 2 <= weight.shape[1] <= 4 and x.shape[-1] % 8 == 0


def causal_conv1d(x, weight, bias=None, initial_state=None, activation="silu", documents=None):
    """causal-conv1d's `causal_conv1d_fn` (``seq_idx`` for packed documents, which it takes without
    states: with both, the torch op runs); shapes as `conv.causal_conv1d` (x [b, s, c])."""
    if not _conv_kernel_takes(x, weight) or (documents is not None and initial_state is not None):
        return conv.causal_conv1d(x, weight, bias, initial_state, activation, documents)
    causal_conv1d_fn = _kernel("causal_conv1d", "causal_conv1d_fn")

    x_cl = x.contiguous().transpose(1, 2)  # [b, c, s], channel-last: states need stride(1) == 1
    if documents is not None:
        y = causal_conv1d_fn(x_cl, weight, bias, seq_idx=documents.seq_idx, activation=activation)
        return y.transpose(1, 2), conv.last_inputs(F.pad(x_cl, (weight.shape[1] - 1, 0)), weight.shape[1],
                                                   documents.ids)
    if initial_state is not None:
        initial_state = initial_state.to(x.dtype).transpose(1, 2).contiguous().transpose(1, 2)  # [b, c, w-1]
    y, final_state = causal_conv1d_fn(
        x_cl, weight, bias, initial_states=initial_state, return_final_states=True, activation=activation,
    )  # y [b, c, s], final_state [b, c, w - 1]
    return y.transpose(1, 2), final_state


def causal_conv1d_step(x, state, weight, bias=None, activation="silu"):
    """causal-conv1d's `causal_conv1d_update`; shapes as `conv.causal_conv1d_step` (x [b, c])."""
    if not _conv_kernel_takes(x, weight):
        return conv.causal_conv1d_step(x, state, weight, bias, activation)
    causal_conv1d_update = _kernel("causal_conv1d", "causal_conv1d_update")

    new_state = state.to(x.dtype, copy=True, memory_format=torch.contiguous_format)  # updated in place
    y = causal_conv1d_update(x, new_state, weight, bias, activation)  # [b, c]
    return y, new_state


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=True, chunk_size=64, documents=None
):
    """fla's `chunk_gated_delta_rule` (fp16/bf16 only; it uses its own chunk size of 64; packed
    documents as fla's variable-length batch of one, ``cu_seqlens``); shapes as
    `gated_delta_rule.chunk_gated_delta_rule`."""
    if not _kernel_takes(q, (torch.float16, torch.bfloat16)):
        return gated_delta_rule.chunk_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, documents
        )
    fla_chunk_gated_delta_rule = _kernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")

    b, s = q.shape[:2]
    varlen = {}
    if documents is not None:
        docs = documents.varlen
        q, k, v, g, beta = (t.flatten(0, 1)[None] for t in (q, k, v, g, beta))  # [1, b * s, ...]
        if initial_state is not None:  # the first document of each sample continues it, the others start at 0
            initial_state = initial_state.new_zeros(docs.count, *initial_state.shape[1:]).index_copy(
                0, docs.first, initial_state)
        varlen = dict(cu_seqlens=docs.cu_seqlens, cu_seqlens_cpu=docs.cu_seqlens_cpu)
    o, final_state = fla_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, **varlen,
    )  # o [b, s, h, d_v] (or [1, b * s, ...]), final_state [b (or documents), h, d_k, d_v] fp32
    if documents is not None:
        o = o.view(b, s, *o.shape[2:])
        final_state = None if final_state is None else final_state[docs.last]  # each sample's last document
    return o.to(v.dtype), final_state


def gated_delta_rule_step(q, k, v, g, beta, state, scale=None):
    """fla's `fused_recurrent_gated_delta_rule` on one token; shapes as
    `gated_delta_rule.gated_delta_rule_step` (q [b, h, d_k])."""
    if not _kernel_takes(q):
        return gated_delta_rule.gated_delta_rule_step(q, k, v, g, beta, state, scale)
    fused_recurrent_gated_delta_rule = _kernel("fla.ops.gated_delta_rule", "fused_recurrent_gated_delta_rule")

    o, new_state = fused_recurrent_gated_delta_rule(
        q=q[:, None], k=k[:, None], v=v[:, None], g=g[:, None], beta=beta[:, None],  # [b, 1, h, ...]
        scale=scale, initial_state=state, output_final_state=True,
    )
    return o[:, 0].to(v.dtype), new_state


def ssd_chunk_scan(x, dt, A, B, C, D=None, initial_state=None, output_final_state=True, chunk_size=64,
                   documents=None):
    """mamba-ssm's `mamba_chunk_scan_combined` with ngroups = nheads (packed documents as its
    ``seq_idx``); shapes as `ssd.ssd_chunk_scan` (states [b, h, n, p]; mamba's are [b, h, p, n])."""
    if not _kernel_takes(x):
        return ssd.ssd_chunk_scan(x, dt, A, B, C, D, initial_state, output_final_state, chunk_size, documents)
    mamba_chunk_scan_combined = _kernel("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")

    if initial_state is not None:
        initial_state = initial_state.transpose(-1, -2).contiguous()  # [b, h, p, n]
    seq_idx = None if documents is None else documents.seq_idx
    out = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, seq_idx=seq_idx,
        return_final_states=output_final_state,
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
    selective_state_update = _kernel("mamba_ssm.ops.triton.selective_state_update", "selective_state_update")

    h, p, n = x.shape[1], x.shape[-1], B.shape[-1]
    new_state = state.transpose(-1, -2).clone(memory_format=torch.contiguous_format)  # [b, h, p, n], in place
    y = selective_state_update(
        new_state,
        x,  # [b, h, p]
        dt[..., None].expand(-1, -1, p),  # [b, h, p], already softplus-ed
        A[:, None, None].expand(-1, p, n),  # [h, p, n]
        B,  # [b, h, n]  (ngroups = nheads)
        C,
        # [h, p]; zeros for None: mamba-ssm 2.3.2 reads D.stride() even when it is None
        D=(dt.new_zeros(h) if D is None else D)[:, None].expand(-1, p),
        dt_bias=dt.new_zeros(h, p),  # mamba-ssm 2.3.2 reads dt_bias.stride() even when it is None
        dt_softplus=False,
    )  # [b, h, p]
    return y, new_state.transpose(-1, -2)


# Sparse block of the FlexAttention BlockMask: without max-autotune inductor tries one tile config per GPU
# and refuses sparse blocks that are not multiples of its tiles; those reach 128 (sm90 bf16, d 64: forward
# BLOCK_M = BLOCK_N = 128, backward BLOCK_N1 = BLOCK_M2 = 128), so blocks are multiples of 128.
FLEX_BLOCK_SIZE = 128


def block_sparse_causal_attention(q, k, v, reads, scale=None, document_ids=None):
    """torch's FlexAttention (compiled once for every length: dynamic shapes) with a block mask from
    ``reads`` (``attention.BlockReads``; and ``document_ids``), built once per ``reads`` and key length: query
    blocks (``reads.block_size`` rounded up to a multiple of FLEX_BLOCK_SIZE) with no reading position are
    skipped by the kernel, as are the key blocks of other documents; shapes as
    `attention.block_sparse_causal_attention`."""
    if not _kernel_takes(q):
        return attention.block_sparse_causal_attention(q, k, v, reads, scale, document_ids)
    block, kv_len = -(-reads.block_size // FLEX_BLOCK_SIZE) * FLEX_BLOCK_SIZE, k.shape[1]
    mask = reads.derived(("flex", kv_len), lambda: read_block_mask(reads.read, kv_len, block, document_ids))
    o = _compiled_flex_attention()(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # [b, h, s, d]
        block_mask=mask, scale=scale,
    )  # [b, h, sq, d_v]
    return o.transpose(1, 2)


def read_block_mask(read, kv_len: int, block_size: int, document_ids=None):
    """FlexAttention's BlockMask of the block-sparse read, as `attention.block_sparse_causal_attention`
    computes it: query block i (of the last read.shape[1] of kv_len positions) is computed where one of
    its positions reads, causally against every key up to each query's position (kv blocks wholly
    before its first query are full blocks, the diagonal ones apply the causal mask) and, with
    document_ids [b, kv_len], of its own document (a kv block is full only within one document, and
    skipped when it ends before the query block's first document starts); other blocks are skipped
    (zeros). Built from [b, n_q, n_kv] block tables (no [b, sq, kv_len] mask is materialised)."""
    from torch.nn.attention.flex_attention import BlockMask

    b, sq = read.shape
    n_q, n_kv = -(-sq // block_size), -(-kv_len // block_size)
    reads = F.pad(read, (0, n_q * block_size - sq)).view(b, n_q, block_size).any(-1)[..., None]  # [b, n_q, 1]
    first = kv_len - sq + torch.arange(n_q, device=read.device)[:, None] * block_size  # [n_q, 1] first query
    kv_start = torch.arange(n_kv, device=read.device) * block_size  # [n_kv]
    full = reads & (kv_start + block_size - 1 <= first)  # [b, n_q, n_kv]: every key before every query
    partial = reads & (kv_start < first + block_size) & ~full  # some key before some query
    offset = torch.tensor(kv_len - sq, device=read.device)  # a tensor: a new offset does not recompile

    def causal(batch, head, q_idx, kv_idx):
        return kv_idx <= q_idx + offset

    def causal_within_documents(batch, head, q_idx, kv_idx):
        return (kv_idx <= q_idx + offset) & (document_ids[batch, kv_idx] == document_ids[batch, q_idx + offset])

    mask_mod = causal
    if document_ids is not None:
        low, high = (t[:, None] for t in _block_documents(document_ids, block_size))  # [b, 1, n_kv] each
        q_low, q_high = (t[..., None] for t in _block_documents(document_ids[:, kv_len - sq:], block_size))
        same = (q_low == q_high) & (low == high) & (low == q_low)  # [b, n_q, n_kv]: all in one document
        overlap = high >= q_low  # the kv block reaches the query block's first document
        partial = (partial | (full & ~same)) & overlap
        full, mask_mod = full & same, causal_within_documents

    return BlockMask.from_kv_blocks(*_block_lists(partial), *_block_lists(full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(sq, kv_len))


def _block_documents(document_ids: torch.Tensor, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first and last document of each block of document_ids [b, s] (ids never decrease along a
    sample): [b, n] each."""
    b, s = document_ids.shape
    n = -(-s // block_size)
    padded = F.pad(document_ids[:, None], (0, n * block_size - s), mode="replicate")[:, 0]  # [b, n * block]
    blocks = padded.view(b, n, block_size)
    return blocks[..., 0], blocks[..., -1]


def _block_lists(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """[b, n_q, n_kv] bool -> FlexAttention's (counts [b, 1, n_q], kv block indices [b, 1, n_q, n_kv],
    the listed blocks first and in order)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


@functools.lru_cache(maxsize=None)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def gated_rms_norm(y, gate, weight, eps=1e-5):
    """mamba-ssm's fused `rmsnorm_fn` (one Triton kernel forward, one backward) with a group per
    head; shapes as `norm.gated_rms_norm`."""
    if not _kernel_takes(y):
        return norm.gated_rms_norm(y, gate, weight, eps)
    rmsnorm_fn = _kernel("mamba_ssm.ops.triton.layernorm_gated", "rmsnorm_fn")

    *lead, h, d = y.shape
    o = rmsnorm_fn(y.reshape(-1, h * d), weight, None, z=gate.reshape(-1, h * d), eps=eps, group_size=d,
                   norm_before_gate=True)  # [b * s, h * d]
    return o.view(*lead, h, d)
