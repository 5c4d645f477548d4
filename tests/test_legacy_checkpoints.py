"""Checkpoints and Hugging Face folders written at 3486e45 (tests/fixtures/legacy_3486e45) load with today's code
and give the logits that code computed: megatron and HF, every family, modes, documents, cached decode, router."""

from pathlib import Path

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.inference.checkpoint import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "legacy_3486e45"
FAMILIES = ["oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer"]
PREFILL = 16


def _decode(model, ids, modes):
    cache = model.allocate_inference_cache(ids.shape[0], torch.float32, capacity=32)
    steps = [model(ids[:, :PREFILL], modes[:, :PREFILL], inference_cache=cache)]
    steps += [model(ids[:, t:t + 1], modes[:, t:t + 1], inference_cache=cache) for t in range(PREFILL, ids.shape[1])]
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_checkpoint_gives_the_logits_it_gave(single_process_parallel, family):
    expected = torch.load(FIXTURES / family / "expected.pt")
    model, _ = load_model(str(FIXTURES / family / "ckpt"))
    ids, modes, docs = expected["ids"], expected["modes"], expected["document_ids"]
    with torch.no_grad():
        got = {"logits": model(ids, None if family == "transformer" else modes),
               "logits_documents": model(ids, None if family == "transformer" else modes, document_ids=docs)}
        if family != "transformer":
            got["logits_decode"] = _decode(model, ids, modes)
        if family.startswith("oryx"):
            got["logits_attention"] = model(ids, Mode.ATTENTION)
            got["logits_linear"] = model(ids, Mode.LINEAR)
        if family == "oryx_tg":
            got["router_logits"] = model.route(ids, 8)
            got["router_logits_documents"] = model.route(ids, 8, docs)
    assert set(got) == set(expected) - {"ids", "modes", "document_ids"}
    for name, logits in got.items():  # fp32 rounding of another CPU's kernels: seen up to 5e-7 (logits ~0.5)
        gap = (logits - expected[name]).abs().max()
        assert logits.shape == expected[name].shape and gap <= 2e-6, f"{family} {name}: {gap}"


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_folder_gives_the_logits_the_megatron_model_gave(family):
    from transformers import AutoModelForCausalLM

    import oryx_megatron.hf  # noqa: F401  (registers the oryx model type)

    expected = torch.load(FIXTURES / family / "expected.pt")
    model = AutoModelForCausalLM.from_pretrained(FIXTURES / family / "hf", dtype=torch.float32).eval()
    ids, modes, docs = expected["ids"], expected["modes"], expected["document_ids"]
    vocab = model.config.vocab_size
    with torch.no_grad():
        if family == "transformer":
            got = {"logits": model(ids).logits}
        else:
            got = {"logits": model(ids, modes=modes).logits,
                   "logits_documents": model(ids, modes=modes, document_ids=docs).logits}
    for name, logits in got.items():
        assert (logits - expected[name][..., :vocab]).abs().max() <= 1e-5, f"{family} {name}"
