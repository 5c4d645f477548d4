"""Context parallelism is exact: CP=2 and CP=4 (head all-to-all, megatron's load-balanced split of every sequence)
equal CP=1 on the same weights, for the layer and the whole model, outputs, input gradients and every parameter
gradient (summed over the context-parallel ranks, as megatron's DDP reduces them), every family and attention with
every registered linear mixer (``linear_families``; each family a test whose id names it), with chunked
random modes, packed documents whose boundaries fall inside the CP chunks and exactly at their edges, and, over two
query blocks (S=256), the block-sparse attention skipping the blocks no token of a sequence reads; TP=2 x CP=2 (4
gloo processes) equals TP=1, every family; the router (Oryx-TG and Oryx-TM, of one and of two layers) at CP=2 equals
CP=1.
fp64 but for the model's loss (megatron's vocab-parallel cross entropy computes in fp32)."""

import contextlib
import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import Mode
from oryx_megatron.mixer import QUERY_BLOCK, MixerContext
from oryx_megatron.mixer.attention import SDPAttention
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.ops.chunking import document_starts
from oryx_megatron.parallel import initialize_parallel
from tests.distributed import run_distributed
from tests.helpers import PATTERN, build_mixer, linear_families, tiny_args
from tests.test_tensor_parallel import load, save

B, S, HIDDEN, VOCAB = 2, 32, 64, 97  # S divides by 2 x CP for CP = 2 (and 4)
LONG = 2 * QUERY_BLOCK  # two query blocks of the block-sparse attention, in each of which one sequence reads none
FAMILIES = [*linear_families(), "gdn", "mamba2", "transformer"]
TOLERANCE = {"mixer": 1e-10, "model": 1e-5}


def chunk_owner(chunk: int, cp: int) -> int:
    """The context-parallel rank that holds chunk ``chunk`` of 2 cp (rank r: chunks r and 2 cp - 1 - r)."""
    return chunk if chunk < cp else 2 * cp - 1 - chunk


def this_rank_tokens(t: torch.Tensor, dim: int) -> torch.Tensor:
    """This context-parallel rank's tokens of whole sequences: chunks r and 2 cp - 1 - r of 2 cp along ``dim``."""
    cp, r = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[r], chunks[2 * cp - 1 - r]], dim=dim)


def packed_documents(s: int) -> torch.Tensor:
    """[B, s] document ids: sequence 0's documents start at 5/32 and 19/32 of s (inside CP chunks), sequence 1's at
    1/4 and 3/4 of s (at the edges of CP chunks, where one rank's tokens end and another's begin, at CP = 2 and 4)."""
    ids = torch.zeros(B, s, dtype=torch.long)
    for row, starts in enumerate([(5 * s // 32, 19 * s // 32), (s // 4, 3 * s // 4)]):
        for start in starts:
            ids[row, start:] += 1
    return ids


def document_start_positions(documents: torch.Tensor, cp: int):
    """(inside a CP chunk, at a chunk edge between two ranks): the positions where a document starts, besides 0."""
    chunk = documents.shape[1] // (2 * cp)
    starts = sorted(document_starts(documents).nonzero()[:, 1].tolist())
    edges = [p for p in starts if p % chunk == 0 and chunk_owner(p // chunk - 1, cp) != chunk_owner(p // chunk, cp)]
    return [p for p in starts if p % chunk], edges


def inputs(seed=0, s=S):
    """x, dy [s, B, HIDDEN]; modes [B, s] random in chunks of 4, but over more than one query block sequence
    (i + 1) % B reads no attention in block i; ids [B, s + 1]; ``packed_documents``."""
    g = torch.Generator().manual_seed(seed)
    x, dy = (torch.randn(s, B, HIDDEN, generator=g, dtype=torch.float64) for _ in range(2))
    modes = torch.randint(0, 2, (B, s // 4), generator=g, dtype=torch.int8).repeat_interleave(4, 1)
    for block in range(s // QUERY_BLOCK if s > QUERY_BLOCK else 0):
        modes[(block + 1) % B, block * QUERY_BLOCK:(block + 1) * QUERY_BLOCK] = Mode.LINEAR
    ids = torch.randint(0, VOCAB, (B, s + 1), generator=g)
    return x, dy, modes, ids, packed_documents(s)


def unread_blocks(modes: torch.Tensor) -> int:
    """The (sequence, query block) pairs in which no token reads attention: what the block-sparse attention skips."""
    return sum(int((block != Mode.ATTENTION).all(1).sum()) for block in modes.split(QUERY_BLOCK, 1))


@contextlib.contextmanager
def skipped_blocks(module):
    """Per call of the module's softmax attention (each ``SDPAttention``), the (sequence, query block) pairs whose
    output is zero: those the block-sparse attention left uncomputed (a computed block averages random values)."""
    counts = []

    def count(_module, _inputs, o):  # o [b, s, h, d_v]
        counts.append(sum(int(block.flatten(1).eq(0).all(1).sum()) for block in o.split(QUERY_BLOCK, 1)))

    hooks = [m.register_forward_hook(count) for m in module.modules() if isinstance(m, SDPAttention)]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def mixer_step(module, s=S):
    """(output, input gradient) of this rank's tokens, the parameter gradients summed over the CP ranks."""
    x, dy, modes, _, documents = inputs(s=s)
    x = this_rank_tokens(x, 0).clone().requires_grad_()
    out, _ = module(x, MixerContext.build(module.config, modes, documents))
    (out * this_rank_tokens(dy, 0)).sum().backward()
    return out.detach(), x.grad


def model_step(module, s=S):
    _, _, modes, ids, documents = inputs(s=s)
    with cuda_to_cpu():  # megatron's context-parallel rotary places its indices on the GPU
        loss = module(this_rank_tokens(ids[:, :-1], 1), modes, labels=this_rank_tokens(ids[:, 1:], 1),
                      document_ids=documents)
    (loss * this_rank_tokens(torch.linspace(0.5, 1.5, s, dtype=loss.dtype)[None], 1)).sum().backward()
    return loss.detach(), None


def build(level, family, **parallel):
    if level == "mixer":
        return build_mixer(family, seed=0, parallel=parallel)
    args = tiny_args(family)
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64, **parallel))


def ref_layout(ref, level):
    return (ref if level == "mixer" else ref.decoder.layers[0].mixer).layout


def summed_grads(module):
    """Every parameter's gradient summed over the context-parallel ranks (and, for the norms of sequence
    parallelism, over the tensor-parallel ranks), as megatron's DDP and finalize_model_grads sum them."""
    grads = {}
    for name, p in module.named_parameters():
        if p.grad is None:  # not on this loss's path (the layers after the router's first)
            continue
        g = p.grad.clone()
        dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(g, group=parallel_state.get_tensor_model_parallel_group())
        grads[name] = g
    return grads


def cp_equals_cp1(tmp: str, level: str, families=FAMILIES, tp: int = 1, cp: int = 2, sp: bool = False,
                  seq_length: int = S):
    """CP=cp (x TP=tp) equals one rank on sequences of ``seq_length`` (``inputs``): the weights travel from one rank
    through a distributed checkpoint, the CP-summed gradients back the same way (saved at TP=tp in place of the
    weights, loaded at TP=1). Both layouts' softmax attention skips exactly the ``unread_blocks`` of the modes."""
    step = mixer_step if level == "mixer" else model_step
    unread = unread_blocks(inputs(s=seq_length)[2])
    for family in families if level == "model" else [f for f in families if f != "transformer"]:
        case = Path(tmp) / family
        initialize_parallel(tensor_model_parallel_size=1)
        ref = build(level, family)
        with skipped_blocks(ref) as skipped_ref:
            out_ref, dx_ref = step(ref, seq_length)
        grads_ref = {n: p.grad for n, p in ref.named_parameters()}
        save(ref, case / "weights")

        initialize_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        split = build(level, family, tensor_model_parallel_size=tp, context_parallel_size=cp, sequence_parallel=sp)
        load(split, case / "weights")
        if family != "transformer":
            mixer = split if level == "mixer" else split.decoder.layers[0].mixer
            assert mixer.shard.cp.size == cp and mixer.layout == ref_layout(ref, level)
        with skipped_blocks(split) as skipped:
            out, dx = step(split, seq_length)
        # every attention call (one per layer; none in a family without softmax attention) skips the unread blocks
        assert skipped == skipped_ref == expected_skips(ref, level, unread), f"{family} skipped blocks"
        dim = 0 if level == "mixer" else 1
        assert (out - this_rank_tokens(out_ref, dim)).abs().max() < TOLERANCE[level], f"{family} output"
        if dx is not None:
            assert (dx - this_rank_tokens(dx_ref, 0)).abs().max() < TOLERANCE[level], f"{family} input grad"
        with torch.no_grad():
            for name, grad in summed_grads(split).items():
                dict(split.named_parameters())[name].copy_(grad)
        save(split, case / "grads")

        initialize_parallel(tensor_model_parallel_size=1)
        back = build(level, family)
        load(back, case / "grads")
        for name, p in back.named_parameters():
            assert (p - grads_ref[name]).abs().max() < TOLERANCE[level], f"{family} grad of {name}"


def expected_skips(module, level: str, unread: int) -> list:
    """Per softmax-attention call of ``module``, the blocks it skips: ``unread`` in a layer that reads the tokens'
    modes, none in an attention layer of a layer pattern (every token reads it); no call without attention."""
    mixers = [module]
    if level == "model":  # the Transformer's layers have no Oryx mixer
        mixers = [layer.mixer for layer in module.decoder.layers if hasattr(layer, "mixer")]
    return [unread if mixer.config.is_multi_mixer else 0 for mixer in mixers if mixer.layout.attention_query]


def each_case(tmp: str, level: str, cases: list):
    """``cp_equals_cp1`` of every case (its keyword arguments) in one set of processes."""
    for i, case in enumerate(cases):
        cp_equals_cp1(f"{tmp}/{i}", level, **case)


def assert_documents_cross_chunks(cp: int, s: int = S):
    """``packed_documents`` start inside CP chunks and exactly at chunk edges between two ranks, where they claim."""
    inside, at_edges = document_start_positions(packed_documents(s), cp)
    assert (inside, at_edges) == ([5 * s // 32, 19 * s // 32], [s // 4, 3 * s // 4])


@pytest.mark.parametrize("level,family", [(level, family) for level in ("mixer", "model") for family in FAMILIES
                                          if level == "model" or family != "transformer"])
def test_context_parallel_equals_one_rank(tmp_path, level, family):
    """CP=2: the family at S=32 (one query block, read by both sequences), and attention with each linear mixer over
    two query blocks, in each of which one sequence reads no attention: 2 blocks skipped per attention call."""
    assert_documents_cross_chunks(2)
    assert_documents_cross_chunks(2, LONG)
    assert unread_blocks(inputs()[2]) == 0 and unread_blocks(inputs(s=LONG)[2]) == 2
    cases = [dict(families=[family])] + [dict(families=[family], seq_length=LONG)] * (family in linear_families())
    run_distributed(each_case, str(tmp_path), level, cases)


def test_a_layer_pattern_at_context_parallel_equals_one_rank(tmp_path):
    """CP=2, a model of every kind of layer (``PATTERN``): its Oryx block skips the unread blocks, its attention
    layer none."""
    cases = [dict(families=[PATTERN]), dict(families=[PATTERN], seq_length=LONG)]
    run_distributed(each_case, str(tmp_path), "model", cases)


@pytest.mark.four_ranks
@pytest.mark.parametrize("level,sp", [("mixer", False), ("model", True)])
def test_four_context_parallel_ranks_alone_and_with_tensor_parallelism_equal_one_rank(tmp_path, level, sp):
    """CP=4, and TP=2 x CP=2 (the model with sequence parallelism), every family: 4 processes, one head per rank
    of the tiny models."""
    assert_documents_cross_chunks(4)
    run_distributed(each_case, str(tmp_path), level, [dict(cp=4), dict(tp=2, cp=2, sp=sp)], world_size=4)


def router_cp_equals_cp1():
    """The router's logits at CP=2 (readouts of this rank's heads over the whole sequence, gathered) equal one
    rank's; a loss split over the ranks gives, summed, one rank's parameter gradients. Oryx-TG and Oryx-TM, a
    router of the first layer and of two (the first layer's all-linear forward, then the second's readouts)."""
    _, _, _, ids, documents = inputs()
    for family, router_layers in itertools.product(("oryx_tg", "oryx_tm"), (1, 2)):
        results = []
        for cp in (1, 2):
            initialize_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
            args = tiny_args(family, router_hidden=8, router_layers=router_layers)
            torch.manual_seed(0)
            model = build_model(args, transformer_config(args, params_dtype=torch.float64, context_parallel_size=cp))
            with torch.no_grad():
                model.router.fc2.weight.normal_()  # nonzero logits (the router starts at p = 0.5)
            logits = model.route(this_rank_tokens(ids[:, :-1], 1), 4, documents)  # [b, S / 4], every chunk's
            share = torch.arange(logits.shape[1]) % cp == parallel_state.get_context_parallel_rank()  # a rank's chunks
            (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits) * share).sum().backward()
            results.append((logits.detach(), summed_grads(model)))
        (ref, ref_grads), (got, grads) = results
        case = f"{family}, router_layers={router_layers}"
        assert (got - ref).abs().max() < 1e-10, case
        assert grads.keys() == ref_grads.keys() and any("router" in n for n in grads), case
        assert any(f"layers.{router_layers - 1}.mixer" in n for n in grads), case  # every routed layer's mixer
        for name, grad in grads.items():
            assert (grad - ref_grads[name]).abs().max() < 1e-10, f"{case}: {name}"


def test_the_router_at_context_parallel_equals_one_rank():
    run_distributed(router_cp_equals_cp1)
