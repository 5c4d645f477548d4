"""Packed documents (data.reset_at_eod) through the whole model: a packed sample gives each document
the logits and gradients it gets alone (fp64, random chunk modes; documents shorter than a mode chunk
and than a kernel chunk, boundaries inside a chunk and on a chunk edge), and prefill + decode with a
cache follows the same resets; for attention with every registered linear mixer (``linear_families``), the
single-mixer baselines and the Transformer."""

import pytest
import torch

from oryx_megatron.models.builder import build_model, transformer_config
from tests.helpers import linear_families, tiny_args
from tests.ops.test_ops_documents import LENGTHS, S, document_ids, spans

pytestmark = pytest.mark.usefixtures("single_process_parallel")


def tiny(family, seed=0):
    args = tiny_args(family)
    torch.manual_seed(seed)
    return build_model(args, transformer_config(args, params_dtype=torch.float64)), args


def relative_error(got, want):
    return float((got - want).abs().max() / want.abs().max())


def sample(args, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (len(LENGTHS), S), generator=g)
    modes = torch.randint(0, 2, (len(LENGTHS), S // 4), generator=g, dtype=torch.int8).repeat_interleave(4, 1)
    return tokens, modes


@pytest.mark.parametrize("family,tolerance", [
    *((family, 1e-10) for family in (*linear_families(), "gdn", "mamba2")),
    ("transformer", 1e-8),  # megatron's rotary angles are fp32: a document moved to position 0 rounds anew
])
def test_a_packed_sample_equals_each_document_alone(family, tolerance):
    model, args = tiny(family)
    tokens, modes = sample(args)
    packed = model(tokens, modes, document_ids=document_ids())  # [b, s, vocab]
    weight = torch.randn(packed.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    packed_grads = torch.autograd.grad((packed * weight).sum(), list(model.parameters()))
    alone = torch.zeros_like(packed)
    for b, lengths in enumerate(LENGTHS):
        for lo, hi in spans(lengths):
            alone[b : b + 1, lo:hi] = model(tokens[b : b + 1, lo:hi], modes[b : b + 1, lo:hi])
    alone_grads = torch.autograd.grad((alone * weight).sum(), list(model.parameters()))
    assert relative_error(packed, alone) < tolerance
    for (name, _), got, want in zip(model.named_parameters(), packed_grads, alone_grads):
        assert relative_error(got, want) < tolerance, name
    without = model(tokens, modes)  # the default: documents flow into each other
    assert (without - packed).abs().max() > 1e-3


@pytest.mark.parametrize("family", [*linear_families(), "transformer"])
def test_prefill_and_decode_reset_at_document_starts(family):
    """A cache prefilled with packed documents, then stepped with ``start_documents`` where the next
    token begins a document, gives the logits of the parallel forward over the packed sample."""
    model, args = tiny(family)
    model.eval()  # the Transformer decodes in eval mode
    tokens, modes = sample(args, seed=2)
    docs = document_ids()
    with torch.no_grad():
        want = model(tokens, modes, document_ids=docs)
        cache = model.allocate_inference_cache(tokens.shape[0], torch.float64)
        got = [model(tokens[:, :10], modes[:, :10], inference_cache=cache, document_ids=docs[:, :10])]
        for t in range(10, S):
            starting = docs[:, t] != docs[:, t - 1]
            for layer_cache in cache:
                layer_cache.start_documents(starting)
            got.append(model(tokens[:, t : t + 1], modes[:, t : t + 1], inference_cache=cache))
    assert (torch.cat(got, dim=1) - want).abs().max() < 1e-9


@pytest.mark.parametrize("family", [*linear_families(), "transformer"])
def test_a_prefill_continuing_a_cache_reads_within_documents(family):
    model, args = tiny(family)
    model.eval()
    tokens, modes = sample(args, seed=3)
    docs = document_ids()
    with torch.no_grad():
        want = model(tokens, modes, document_ids=docs)
        cache = model.allocate_inference_cache(tokens.shape[0], torch.float64)
        first = model(tokens[:, :7], modes[:, :7], inference_cache=cache, document_ids=docs[:, :7])
        rest = model(tokens[:, 7:], modes[:, 7:], inference_cache=cache, document_ids=docs[:, 7:])
    assert (torch.cat([first, rest], dim=1) - want).abs().max() < 1e-9


@pytest.mark.parametrize("family,speculative", [("oryx_tg", False), ("oryx_tg", True), ("transformer", False)])
def test_generation_after_an_eod_in_the_prompt_reads_only_the_new_document(family, speculative):
    """With reset_at_eod (a model trained with data.reset_at_eod), a prompt's EOD restarts every state:
    the continuation equals the one of the prompt's last document alone, in the prefill and, for a
    longer prompt of a ragged batch, in the teacher-forced steps after it."""
    from oryx_megatron.inference import generate, speculative_generate

    model, args = tiny(family)
    eod, g = 5, torch.Generator().manual_seed(4)
    words = lambda n: (torch.randint(6, args.vocab_size, (n,), generator=g)).tolist()  # noqa: E731
    after = words(4)
    with_eod = words(6) + [eod] + after  # the EOD at position 6: inside the prefill of a batch of one
    schedule = "prefill=linear decode=attention" if family != "transformer" else "all_attention"
    if speculative:
        run = lambda prompts, **kw: speculative_generate(model, prompts, schedule, 5, 2, output_logits=True, **kw)  # noqa: E731
        got, want = run([with_eod], reset_at_eod=eod), run([after])
    else:
        run = lambda prompts, **kw: generate(model, prompts, schedule, 5, output_logits=True, **kw)  # noqa: E731
        got = run([with_eod, words(3)], reset_at_eod=eod)  # prefill of 3, then steps through the EOD
        want = run([after])
    assert got.tokens[0] == want.tokens[0]
    assert (got.logits[0] - want.logits[0]).abs().max() < 1e-9
    assert (run([with_eod]).logits[0] - want.logits[0]).abs().max() > 1e-6  # without the reset: other logits


@pytest.mark.parametrize("family", linear_families())
def test_a_chunked_prefill_generates_what_one_prefill_does(family):
    """generate(prefill_chunk=N): the prompt through the caches N tokens at a time, an EOD ending one chunk
    (position 7, chunk 4: the next document starts a chunk) or inside one (position 17): the same logits."""
    from oryx_megatron.inference import generate

    model, args = tiny(family)
    eod, g = 5, torch.Generator().manual_seed(6)
    words = lambda n: (torch.randint(6, args.vocab_size, (n,), generator=g)).tolist()  # noqa: E731
    prompt = words(7) + [eod] + words(9) + [eod] + words(6)
    schedule = "random_chunks chunk_size=3 p_attention=0.5"
    whole = generate(model, [prompt], schedule, 6, output_logits=True, reset_at_eod=eod)
    for chunk in (4, 5):
        chunked = generate(model, [prompt], schedule, 6, output_logits=True, reset_at_eod=eod, prefill_chunk=chunk)
        assert chunked.tokens == whole.tokens and (chunked.logits[0] - whole.logits[0]).abs().max() < 1e-9
