"""Causal SDPA attention == an explicit masked softmax, bottom-right aligned; its block-sparse form
== the dense one at every reading position, gradients included."""

import warnings

import pytest
import torch

from oryx_megatron.ops import (
    BlockReads,
    block_sparse_causal_attention,
    causal_attention,
    cuda,
)

B, H, DK, DV = 2, 3, 4, 5


def make_qkv(sq, sk, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return rand(B, sq, H, DK), rand(B, sk, H, DK), rand(B, sk, H, DV)


def reference(q, k, v, scale=None):
    sq, sk = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)  # [sq, sk]
    probs = scores.masked_fill(~visible, -torch.inf).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 7), (1, 7), (1, 1)])
@pytest.mark.parametrize("scale", [None, 0.7])
def test_matches_masked_softmax_fp64(sq, sk, scale):
    q, k, v = make_qkv(sq, sk)
    o = causal_attention(q, k, v, scale=scale)
    assert o.shape == (B, sq, H, DV) and o.dtype == torch.float64
    assert (o - reference(q, k, v, scale)).abs().max() < 1e-12


def test_queries_are_the_last_positions():
    q, k, v = make_qkv(7, 7)
    full = causal_attention(q, k, v)
    assert (causal_attention(q[:, -1:], k, v) - full[:, -1:]).abs().max() < 1e-12
    assert (causal_attention(q[:, -3:], k, v) - full[:, -3:]).abs().max() < 1e-12


def chunk_reads(sq, chunk, p, seed):
    """[B, sq] bool: per chunk of ``chunk`` positions, attention with probability p (as training modes)."""
    gen = torch.Generator().manual_seed(seed)
    per_chunk = torch.rand(B, -(-sq // chunk), generator=gen) < p
    return per_chunk.repeat_interleave(chunk, dim=1)[:, :sq]


def sparse_vs_dense(sq, sk, read, block_size):
    """Outputs and input gradients of a loss over the reading positions, sparse and dense."""
    results = []
    for attend in (lambda q, k, v: block_sparse_causal_attention(q, k, v, BlockReads(read, block_size)),
                   causal_attention):
        q, k, v = (t.requires_grad_() for t in make_qkv(sq, sk, seed=3))
        o = attend(q, k, v)
        w = torch.randn(o.shape, generator=torch.Generator().manual_seed(4), dtype=o.dtype)
        loss = (o * w * read[:, :, None, None]).sum()
        grads = torch.autograd.grad(loss, (q, k, v)) if loss.requires_grad else [torch.zeros_like(t) for t in (q, k, v)]
        results.append((o.detach(), *grads))
    return results


@pytest.mark.parametrize("sq,sk,chunk,block_size", [
    (64, 64, 16, 16),  # chunks = blocks, dividing the length
    (50, 50, 12, 16),  # neither divides the length; chunks straddle blocks
    (37, 37, 8, 8),
    (20, 45, 5, 8),  # queries after a cached prefix (prefill continuing a cache)
])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.7, 1.0])
def test_block_sparse_equals_dense_at_reading_positions_fp64(sq, sk, chunk, block_size, p):
    read = chunk_reads(sq, chunk, p, seed=sq + int(10 * p))
    (o, *grads), (want, *want_grads) = sparse_vs_dense(sq, sk, read, block_size)
    mask = read[:, :, None, None]
    assert ((o - want) * mask).abs().max() < 1e-12
    for got, ref in zip(grads, want_grads):  # only reading positions enter the loss
        assert (got - ref).abs().max() < 1e-12
    if not read.any():
        assert torch.equal(o, torch.zeros_like(o))  # all-linear: no attention computed at all


def test_block_sparse_skips_blocks_without_readers():
    q, k, v = make_qkv(32, 32)
    read = torch.zeros(B, 32, dtype=torch.bool)
    read[0, 9] = True  # one reader in block 1 of sequence 0
    o = block_sparse_causal_attention(q, k, v, BlockReads(read, block_size=8))
    computed = o.abs().sum(dim=(2, 3)) > 0  # [B, sq]
    assert computed[0, 8:16].all() and not computed[0, :8].any() and not computed[0, 16:].any()
    assert not computed[1].any()
    assert (o[0, 8:16] - causal_attention(q, k, v)[0, 8:16]).abs().max() < 1e-12


@pytest.mark.parametrize("sq,sk", [(48, 48), (40, 56)])
def test_flex_block_mask_of_the_cuda_kernel_fp64(sq, sk):
    """The CUDA kernel's block mask, run through eager FlexAttention on the CPU, equals the torch op."""
    from torch.nn.attention.flex_attention import flex_attention

    q, k, v = make_qkv(sq, sk, seed=5)
    read = chunk_reads(sq, 16, 0.5, seed=6)
    read[0, 0] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is meant to be compiled
        o = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)),
                           block_mask=cuda.read_block_mask(read, sk, 16)).transpose(1, 2)
    want = block_sparse_causal_attention(q, k, v, BlockReads(read, 16))
    assert ((o - want) * read[:, :, None, None]).abs().max() < 1e-12


def test_what_a_kernel_derives_from_the_reads_is_built_once_per_key_length():
    """Every layer of a forward shares one BlockReads: one block mask per key length serves them all."""
    reads, built = BlockReads(chunk_reads(48, 16, 0.5, seed=7), 16), []

    def build(kv_len):
        return lambda: built.append(kv_len) or cuda.read_block_mask(reads.read, kv_len, 16)

    mask = reads.derived(("flex", 48), build(48))
    assert reads.derived(("flex", 48), build(48)) is mask and built == [48]
    assert reads.derived(("flex", 64), build(64)) is not mask and built == [48, 64]  # another key length
    flipped = reads.read.clone()
    flipped[0] = ~flipped[0]
    assert not torch.equal(cuda.read_block_mask(flipped, 48, 16).to_dense(), mask.to_dense())
    assert reads.block_lists() is reads.block_lists()


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flex_sparse_block_divides_by_the_tiles_inductor_tries_on_the_gpu(monkeypatch, capability, head_dim, dtype):
    """Without max-autotune inductor tries one FlexAttention tile config per GPU and raises "Q and KV block
    size must be divisible by BLOCK_M and BLOCK_N" (backward: skips the config) otherwise. On sm90 bf16 with
    d 64 the tiles are 128: the 32- and 64-token blocks of earlier probes failed there."""
    from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    heuristic = CUDAConfigHeuristic()
    block = cuda.FLEX_BLOCK_SIZE
    for c in heuristic.get_flex_attn_fwd_configs(head_dim, dtype):
        assert block % c.block_m == 0 and block % c.block_n == 0, c
    for c in heuristic.get_flex_attn_bwd_configs(head_dim, dtype):
        assert all(block % t == 0 for t in (c.block_m1, c.block_n1, c.block_m2, c.block_n2)), c
