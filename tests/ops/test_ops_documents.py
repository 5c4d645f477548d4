"""Packed documents (``ops.Documents``, ``document_ids``): every op on a packed sample equals the op run on each document
alone, outputs, final states and gradients (fp64): documents shorter than a chunk, boundaries inside
a chunk and on a chunk edge, a document of one token, a first document continuing an initial state, a last document
shorter than the short conv's kernel (its final state)."""

import pytest
import torch
import torch.nn.functional as F

from oryx_megatron import ops

CHUNK = 8
LENGTHS = ([5, 3, 12, 1, 11], [16, 16], [32])  # per sample: 5 + 3 ends on the chunk edge 8, then 20, 21 inside
S = 32
H, DK, DV = 2, 4, 3


def document_ids(lengths=LENGTHS):
    return torch.stack([torch.repeat_interleave(torch.arange(len(ls)), torch.tensor(ls)) for ls in lengths])


def spans(lengths):
    start = 0
    for n in lengths:
        yield start, start + n
        start += n


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def compare(op, per_token, shared, kwargs, first_state=None, states=True, attention=False, lengths=LENGTHS):
    """op(*per_token [b, s, ...] sliced, *shared, **kwargs) per document vs packed: outputs and final
    states equal to 1e-10, gradients of a random projection of outputs (+ states) likewise.
    ``first_state``: (name, [b, ...]) passed to each sample's first document only. The scans and the conv
    take the packed documents as ``documents`` (``ops.Documents``), ``attention`` as the keys' ``document_ids``."""
    docs = document_ids(lengths)
    packed = {"document_ids": docs} if attention else {"documents": ops.Documents(docs)}

    def leaves():
        return [t.detach().clone().requires_grad_() for t in per_token + shared]

    def loss_and_grads(outs, finals, inputs):
        w = rand(*outs.shape, seed=7)
        loss = (outs * w).sum() + (sum((f * rand(*f.shape, seed=8 + i)).sum() for i, f in enumerate(finals))
                                   if states else 0)
        return torch.autograd.grad(loss, inputs, allow_unused=True)

    packed_in = leaves()
    extra = {first_state[0]: first_state[1]} if first_state else {}
    out = op(*packed_in, **kwargs, **extra, **packed)
    packed_out, packed_final = (out if isinstance(out, tuple) else (out, None))
    alone_in = leaves()
    outs, finals = torch.zeros_like(packed_out), []
    for b, sample in enumerate(lengths):
        for i, (lo, hi) in enumerate(spans(sample)):
            args = [t[b : b + 1, lo:hi] for t in alone_in[: len(per_token)]] + alone_in[len(per_token):]
            first = {first_state[0]: first_state[1][b : b + 1]} if first_state and i == 0 else {}
            result = op(*args, **kwargs, **first)
            o, final = result if isinstance(result, tuple) else (result, None)
            outs[b : b + 1, lo:hi] = o
        finals.append(final)  # the last document's state is the sample's
    assert (packed_out - outs).abs().max() < 1e-10
    if states:
        assert (packed_final - torch.cat(finals)).abs().max() < 1e-10
    got = loss_and_grads(packed_out, [packed_final] if states else [], packed_in)
    want = loss_and_grads(outs, [torch.cat(finals)] if states else [], alone_in)
    for g, w in zip(got, want):
        assert (g - w).abs().max() < 1e-10


def test_document_ids_of_the_fixture():
    docs = document_ids()
    assert docs[0, :9].tolist() == [0] * 5 + [1] * 3 + [2] and docs[0, 19:22].tolist() == [2, 3, 4]
    assert ops.chunking.document_starts(docs)[0].nonzero().flatten().tolist() == [5, 8, 20, 21]


@pytest.mark.parametrize("per_dimension", [False, True], ids=["per-head", "per-dimension"])
def test_reset_decays_restart_a_recurrence_at_each_document(per_dimension):
    """``chunking.reset_at_document_starts`` on log decays per head [b, s, h] (GDN's g, SSD's dt A) or per key
    dimension [b, s, h, d_k] (GLA's gate): the recurrence S_t = exp(g_t) * S_{t-1} + k_t v_t^T (rows of S decaying
    by their own dimension's decay) over the reset decays equals the recurrence restarted from zero at each
    document start (fp64), and the decays elsewhere are unchanged."""
    b = len(LENGTHS)
    g = -rand(b, S, H, *((DK,) if per_dimension else ()), seed=1).abs() * 0.1
    k, v, state = rand(b, S, H, DK, seed=2), rand(b, S, H, DV, seed=3), rand(b, H, DK, DV, seed=4)
    docs = document_ids()
    reset = ops.chunking.reset_at_document_starts(g, ops.Documents(docs))
    starts = ops.chunking.document_starts(docs)
    assert reset.shape == g.shape and torch.equal(reset[~starts], g[~starts]) and (reset[starts] == -torch.inf).all()

    def decay(log_decay):  # [b, h] or [b, h, d_k] -> [b, h, d_k or 1, 1]
        return (log_decay if per_dimension else log_decay[..., None]).exp()[..., None]

    through, restarted, unreset = state.clone(), state.clone(), state.clone()
    for t in range(S):
        write = k[:, t, :, :, None] * v[:, t, :, None, :]  # [b, h, d_k, d_v]
        through = decay(reset[:, t]) * through + write
        restarted = torch.where(starts[:, t, None, None, None], 0, decay(g[:, t]) * restarted) + write
        unreset = decay(g[:, t]) * unreset + write
        assert (through - restarted).abs().max() < 1e-12, t
    assert (through - unreset).abs().max() > 1e-3  # the resets mattered


@pytest.mark.parametrize("bias", [False, True])
def test_short_conv(bias):
    c = 5
    x, weight = rand(3, S, c), rand(c, 4, seed=1)
    shared = [weight] + ([rand(c, seed=2)] if bias else [])
    compare(ops.causal_conv1d, [x], shared, {})


def test_short_conv_continues_its_initial_state_in_the_first_document_only():
    c = 5
    state = rand(3, c, 3, seed=3)
    compare(lambda x, w, **kw: ops.causal_conv1d(x, w, None, **kw), [rand(3, S, c)], [rand(c, 4, seed=1)], {},
            first_state=("initial_state", state))


# The last document of each sample shorter than the kernel (4): 2 and 1 tokens, and 3 (= w - 1, the state's length)
SHORT_LAST = ([5, 3, 22, 2], [31, 1], [29, 3])


@pytest.mark.parametrize("initial", [False, True], ids=["zero-state", "initial-state"])
def test_short_conv_final_state_when_the_last_document_is_shorter_than_the_kernel(initial):
    """The final state holds the last w - 1 inputs of the last document alone: zeros where the packed inputs hold
    an earlier document's tokens (or the initial state, which belongs to the first document)."""
    c, width = 5, 4
    x, weight = rand(3, S, c), rand(c, width, seed=1)
    state = rand(3, c, width - 1, seed=3) if initial else None
    compare(lambda x, w, **kw: ops.causal_conv1d(x, w, None, **kw), [x], [weight], {},
            first_state=("initial_state", state) if initial else None, lengths=SHORT_LAST)
    _, final = ops.causal_conv1d(x, weight, None, state, documents=ops.Documents(document_ids(SHORT_LAST)))
    assert (final[0, :, :1] == 0).all() and (final[1, :, :2] == 0).all() and (final[0, :, 1:] != 0).all()
    _, unpacked = ops.causal_conv1d(x, weight, None, state)  # without documents the earlier tokens would stay
    assert (unpacked[:2, :, :1] != 0).all()


def gdn_inputs():
    q, k = (F.normalize(rand(3, S, H, DK, seed=i), dim=-1) for i in (1, 2))
    v, g, beta = rand(3, S, H, DV, seed=3), -rand(3, S, H, seed=4).abs() * 0.3, rand(3, S, H, seed=5).sigmoid()
    return [q, k, v, g, beta]


@pytest.mark.parametrize("initial", [False, True])
def test_chunk_gated_delta_rule(initial):
    state = ("initial_state", rand(3, H, DK, DV, seed=6)) if initial else None
    compare(ops.chunk_gated_delta_rule, gdn_inputs(), [], dict(chunk_size=CHUNK), first_state=state)


@pytest.mark.parametrize("initial", [False, True])
def test_ssd_chunk_scan(initial):
    x, B, C = rand(3, S, H, DV, seed=1), rand(3, S, H, DK, seed=2), rand(3, S, H, DK, seed=3)
    dt, A, D = F.softplus(rand(3, S, H, seed=4)), -rand(H, seed=5).exp(), rand(H, seed=6)
    state = ("initial_state", rand(3, H, DK, DV, seed=7)) if initial else None

    def scan(x, dt, B, C, A, D, **kwargs):
        return ops.ssd_chunk_scan(x, dt, A, B, C, D, **kwargs)

    compare(scan, [x, dt, B, C], [A, D], dict(chunk_size=CHUNK), first_state=state)


def test_causal_attention():
    q, k, v = rand(3, S, H, DK, seed=1), rand(3, S, H, DK, seed=2), rand(3, S, H, DV, seed=3)
    compare(ops.causal_attention, [q, k, v], [], {}, states=False, attention=True)


def test_block_sparse_attention_at_the_reading_positions():
    q, k, v = rand(3, S, H, DK, seed=1), rand(3, S, H, DK, seed=2), rand(3, S, H, DV, seed=3)
    read = torch.rand(3, S // 4, generator=torch.Generator().manual_seed(4)).lt(0.5).repeat_interleave(4, 1)
    docs = document_ids()
    got = ops.block_sparse_causal_attention(q, k, v, ops.BlockReads(read, 8), document_ids=docs)
    want = ops.causal_attention(q, k, v, document_ids=docs)
    assert ((got - want) * read[..., None, None]).abs().max() < 1e-12


def test_decode_attention_reads_only_its_document():
    capacity = 10
    q, key, value = rand(2, 1, H, DK, seed=1), rand(2, capacity, H, DK, seed=2), rand(2, capacity, H, DV, seed=3)
    position, start = torch.tensor(6), torch.tensor([0, 4])
    got = ops.decode_attention(q, key, value, position, document_start=start)
    assert (got[0] - ops.causal_attention(q[:1], key[:1, :7], value[:1, :7])[0]).abs().max() < 1e-12
    assert (got[1] - ops.causal_attention(q[1:], key[1:, 4:7], value[1:, 4:7])[0]).abs().max() < 1e-12


@pytest.mark.parametrize("sq", [S, 20])  # the whole sample; queries after 12 cached keys
def test_flex_block_mask_with_documents_equals_the_torch_op(sq):
    """The CUDA path's BlockMask (its document mask), run through eager FlexAttention on the CPU, equals
    the torch op at the reading positions (eager FlexAttention applies the mask function everywhere and
    ignores the block tables: tests/kernels/test_compiled_flex_attention.py checks those, compiled)."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from oryx_megatron.ops import cuda

    q, k, v = rand(3, sq, H, DK, seed=1), rand(3, S, H, DK, seed=2), rand(3, S, H, DV, seed=3)
    read = torch.rand(3, -(-sq // 4), generator=torch.Generator().manual_seed(4)).lt(0.6).repeat_interleave(4, 1)
    read = read[:, :sq]
    docs = document_ids()
    mask = cuda.read_block_mask(read, S, 8, docs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex warns that it is meant to be compiled
        got = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=mask).transpose(1, 2)
    want = ops.block_sparse_causal_attention(q, k, v, ops.BlockReads(read, 8), document_ids=docs)
    assert ((got - want) * read[..., None, None]).abs().max() < 1e-12
    kv_blocks = mask.kv_num_blocks + mask.full_kv_num_blocks  # [b, 1, n_q]: sample 2 is one document
    assert (kv_blocks[0] < kv_blocks[2]).any()  # earlier documents' kv blocks are skipped
