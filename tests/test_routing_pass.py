"""The routing pass is written once (``mixer.router``) and both front ends call it: over the Hugging Face model's
layers it gives the megatron model's router logits, prefill and decode, one routed layer or two (fp64)."""

import pytest
import torch

from oryx_megatron.mixer import router as routing

pytest.importorskip("transformers")
from oryx_megatron.hf import OryxCache  # noqa: E402
from tests.test_hf import converted, megatron_model, tiny_args  # noqa: E402

CHUNK = 4


@pytest.mark.parametrize("family,router_layers", [("oryx_tg", 1), ("oryx_tm", 2)])
def test_the_hugging_face_layers_route_as_megatrons(single_process_parallel, family, router_layers):
    torch.manual_seed(3)
    args = tiny_args(family, router_hidden=8, router_chunk_size=CHUNK, router_layers=router_layers)
    megatron = megatron_model(args, dtype=torch.float64)
    hf = converted(megatron, args, dtype=torch.float64).model
    layers = hf.layers[:router_layers]
    ids = torch.randint(0, 200, (2, 21), generator=torch.Generator().manual_seed(4))
    documents = (torch.arange(21) >= 9).long().expand(2, 21)  # a second document from position 9
    with torch.no_grad():
        want = megatron.route(ids, CHUNK, documents)  # [2, 6]
        got = routing.route(layers, hf.router, hf.embed_tokens(ids), CHUNK, documents)
        assert want.shape == (2, 6) and (got - want).abs().max() <= 1e-12

        # decode: the logit of the chunk that starts at position 20, after a prefill of the 20 tokens before it
        prefix, docs = ids[:, :20], documents[:, :20]
        cache = OryxCache([layer.mixer.allocate_inference_cache(2, torch.float64) for layer in hf.layers])
        hf(prefix, modes="attention", cache=cache, document_ids=docs)  # the model's own pass: any modes
        router_cache = routing.allocate_router_cache(layers, 2, torch.float64)  # None for one routed layer
        if router_cache is not None:
            routing.route(layers, hf.router, hf.embed_tokens(prefix), CHUNK, docs, router_cache)
        step = routing.route_step(layers, hf.router, hf.embed_tokens(ids[:, 20]), cache.layers[0], router_cache)
        assert (step - want[:, 5:]).abs().max() <= 1e-12
