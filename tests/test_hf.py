"""The Hugging Face model (oryx_megatron.hf) against the megatron model it is converted from, in memory: the
same logits under every mode schedule (parallel forward and cached decoding), document resets, the
Transformer as a stock Llama, and the weight layout both ways (docs/hf.md); for attention with every registered
linear mixer (``linear_families``: the tests' GLA under one schedule) and the single-mixer baselines."""


import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from oryx_megatron import RECIPES_DIR  # noqa: E402
from oryx_megatron.config import (
    Mode,  # noqa: E402
    ModelArgs,  # noqa: E402
)
from oryx_megatron.data.documents import document_ids  # noqa: E402
from oryx_megatron.interop.hf_convert import (  # noqa: E402
    hf_config,
    hf_model,
    hf_to_megatron,
    megatron_to_hf,
    model_args,
    router_args,
)
from oryx_megatron.hf.layout import LayoutError  # noqa: E402
from oryx_megatron.inference import as_inference_schedule, generate  # noqa: E402
from oryx_megatron.inference.forward import cached_logits  # noqa: E402
from oryx_megatron.config.model import FAMILY_MIXERS  # noqa: E402
from oryx_megatron.models.builder import build_model, transformer_config  # noqa: E402
from tests.helpers import PATTERN, family_cases, linear_families, recipe_fields  # noqa: E402

EOD = 256
# Each family with the options that change the layout (gates, query conv, a shared query, d_v != d_k).
OPTIONS = {
    "oryx_tg": dict(kv_gate="sigmoid", attention_query_conv=True),
    "oryx_tm": dict(shared_query=True, value_head_dim=48),
    "gdn": dict(value_head_dim=48),
    "mamba2": dict(kv_gate="silu"),
}
PATTERNS = {PATTERN: recipe_fields(PATTERN)}  # on its family's tiny recipe (4 layers, as many as letters)
FAMILIES = [*linear_families(), "gdn", "mamba2"]
MODELS = [*FAMILIES, *PATTERNS]
SCHEDULES = ("all_attention", "all_linear", "random_chunks chunk_size=16 p_attention=0.5",
             "prefill=linear decode=attention")
PROMPT, LENGTH = 150, 166  # a prompt over one 128-position query block, then 16 decode steps


def tiny_args(family: str, **overrides) -> ModelArgs:
    """The family's tiny recipe (recipes/model/tiny_<family>.yaml; for mixers of family 'oryx',
    'attention+gla', Oryx-TG's with those mixers) with the options of OPTIONS."""
    if family in PATTERNS:
        return tiny_args(**{**PATTERNS[family], **overrides})
    name = family if family in FAMILY_MIXERS else "oryx_tg"
    recipe = OmegaConf.to_container(OmegaConf.load(RECIPES_DIR / "model" / f"tiny_{name}.yaml"))
    return ModelArgs(**{**recipe, **recipe_fields(family), "linear_chunk_size": 16, **OPTIONS.get(family, {}),
                        **overrides})


def megatron_model(args: ModelArgs, dtype=torch.float32):
    """A random model whose every weight is perturbed (norm weights are not ones, decays not at their init)."""
    model = build_model(args, transformer_config(args, params_dtype=dtype, bf16=dtype == torch.bfloat16)).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    return model


def converted(model, args: ModelArgs, dtype=torch.float32, **config):
    hf = hf_config(args, eod_id=EOD)
    for key, value in config.items():
        setattr(hf, key, value)
    return hf_model(hf, megatron_to_hf(model.state_dict(), hf), dtype)


@pytest.fixture(scope="module")
def models(single_process_parallel, one_thread):
    torch.manual_seed(0)
    built = {}
    for family in MODELS:
        model = megatron_model(tiny_args(family))
        built[family] = (model, converted(model, tiny_args(family)))
    return built


@pytest.mark.parametrize("family", MODELS)
def test_stream_layout_is_megatrons(models, family):
    """Both front ends lay the fused projection out from their own config (megatron's OryxConfig, the HF config's
    mixer fields) into the same streams."""
    for megatron, hf in zip(models[family][0].decoder.layers, models[family][1].model.layers, strict=True):
        assert megatron.mixer.layout == hf.mixer.layout and megatron.mixer.layout.conv_streams


def cached_run(step, ids, modes):
    """Prefill PROMPT tokens in two calls (the second continues the cache), then one token at a time, each with
    its positions' modes: logits [b, LENGTH, V]."""
    logits = [step(ids[:, :100], modes[:, :100]), step(ids[:, 100:PROMPT], modes[:, 100:PROMPT])]
    for t in range(PROMPT, ids.shape[1]):
        logits.append(step(ids[:, t : t + 1], modes[:, t : t + 1]))
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("family,schedule", [
    *family_cases(SCHEDULES[2], *SCHEDULES[:2], SCHEDULES[3], families=FAMILIES),
    *(pytest.param(pattern, schedule, id=f"{pattern}-{schedule}") for pattern in PATTERNS for schedule in SCHEDULES)])
def test_logits_equal_megatrons_under_every_schedule(models, family, schedule):
    megatron, hf = models[family]
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, LENGTH))
    modes = torch.from_numpy(as_inference_schedule(schedule).position_modes(PROMPT, LENGTH)).long().expand(2, -1)
    with torch.no_grad():
        want = megatron(ids, modes)
        got = hf(ids, modes=modes).logits
        assert (got - want).abs().max() <= 1e-5  # the parallel forward

        caches = megatron.allocate_inference_cache(2, torch.float32)
        want_cached = cached_run(lambda x, m: cached_logits(megatron, x, m, caches), ids, modes)
        cache = hf.allocate_cache(2)
        got_cached = cached_run(lambda x, m: hf(x, modes=m, past_key_values=cache).logits, ids, modes)
        assert cache.seqlen == LENGTH
    assert (got_cached - want_cached).abs().max() <= 1e-5  # prefill and decode through the caches
    # and its own parallel forward, up to the fp32 rounding of the per-token recurrence against the chunked
    # scan (megatron's own invariant, tested in fp64 in tests/test_multi_mixer.py)
    assert (got_cached - got).abs().max() <= 5e-5


def test_mode_arguments_and_defaults(models):
    megatron, hf = models["oryx_tg"]
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        attention = megatron(ids, Mode.ATTENTION)
        assert torch.equal(hf(ids).logits, attention)  # default_mode: the model's attention mode
        assert torch.equal(hf(ids, modes="attention").logits, attention)
        assert torch.equal(hf(ids, modes="all_linear").logits, megatron(ids, Mode.LINEAR))  # a schedule text
        assert torch.equal(hf(ids, modes=torch.ones(40, dtype=torch.long)).logits, attention)  # [s] per token
    with pytest.raises(ValueError, match=r"modes: unknown mode 2"):
        hf(ids, modes=torch.full((1, 40), 2))
    with torch.no_grad():  # left padding: the row's logits as without it (tests/test_hf_generate.py: generation)
        padded = hf(ids, attention_mask=(torch.arange(40) >= 3).long()[None], modes="all_linear").logits[:, 3:]
        assert (padded - hf(ids[:, 3:], modes="all_linear").logits).abs().max() <= 5e-5  # chunks shifted: fp32 rounding


def test_linear_only_cache_refuses_attention(models):
    hf = models["oryx_tm"][1]
    cache = hf.allocate_cache(1, kv_cache=False)
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        hf(ids, modes="linear", past_key_values=cache)
        assert cache.layers[0].key is None
        with pytest.raises(ValueError, match="keeps no KV cache"):
            hf(ids[:, :1], modes="attention", past_key_values=cache)


@pytest.mark.parametrize("family", linear_families())
def test_packed_documents_reset_at_eod(models, family):
    """A model trained with data.reset_at_eod: the HF model finds the documents from the EOD token (megatron is
    given them), in the parallel forward and in generation after EODs in the prompt (``generate``'s reset_at_eod)."""
    megatron, _ = models[family]
    hf = converted(megatron, tiny_args(family), reset_at_eod_token_id=EOD)
    torch.manual_seed(2)
    ids = torch.randint(0, 256, (2, LENGTH))
    ids[0, 40] = ids[0, 100] = ids[1, 77] = EOD
    modes = torch.from_numpy(as_inference_schedule(SCHEDULES[2]).position_modes(LENGTH, LENGTH)).long().expand(2, -1)
    with torch.no_grad():
        want = megatron(ids, modes, document_ids=document_ids(ids, EOD))
        assert (hf(ids, modes=modes).logits - want).abs().max() <= 1e-5
        assert (hf(ids, modes=modes).logits - megatron(ids, modes)).abs().max() > 1e-2  # the reset matters
    prompt = ids[:1, :30].clone()
    prompt[0, 10] = prompt[0, 29] = EOD
    for schedule in ("all_attention", "prefill=linear decode=attention"):
        want = generate(megatron, prompt.tolist(), schedule, 12, stop_token_ids=[EOD], reset_at_eod=EOD).tokens[0]
        for use_cache in (True, False):
            got = hf.generate(prompt, schedule=schedule, max_new_tokens=12, do_sample=False, use_cache=use_cache,
                              eos_token_id=EOD, pad_token_id=EOD)
            assert got[0, 30:].tolist()[: len(want)] == want, (schedule, use_cache)


def test_bf16_model_keeps_the_ssm_scalars_in_fp32(single_process_parallel):
    torch.manual_seed(3)
    args = tiny_args("oryx_tm")
    megatron = megatron_model(args, torch.bfloat16)
    hf = converted(megatron, args, torch.bfloat16)
    dtypes = {name: p.dtype for name, p in hf.named_parameters()}
    assert {d for n, d in dtypes.items() if ".linear_mixer." in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".linear_mixer." not in n} == {torch.bfloat16}
    ids = torch.randint(0, 256, (2, 100))
    modes = torch.from_numpy(as_inference_schedule(SCHEDULES[2]).position_modes(100, 100)).long().expand(2, -1)
    with torch.no_grad():
        assert (hf(ids, modes=modes).logits.float() - megatron(ids, modes).float()).abs().max() <= 1e-5


@pytest.mark.parametrize("family", [*MODELS, "transformer"])
def test_weights_convert_both_ways_bit_for_bit(single_process_parallel, family):
    torch.manual_seed(4)
    args = tiny_args(family, share_embeddings_and_output_weights=family != "gdn")  # gdn: an untied output layer
    model = megatron_model(args)
    config = hf_config(args, eod_id=EOD)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    back = hf_to_megatron(megatron_to_hf(model.state_dict(), config), config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert hf_config(model_args(config), eod_id=EOD).to_dict() == config.to_dict()  # the recipe read back


def test_the_chunk_router_travels_with_the_weights(single_process_parallel, tmp_path):
    """A model with a router (docs/routing.md): its weights, calibration and price through a saved HF
    folder and back, bit for bit (the HF model carries them; it does not route)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    args = tiny_args("oryx_tm", router_hidden=8, router_chunk_size=4)
    model = megatron_model(args)
    with torch.no_grad():
        model.router.fc2.weight.normal_()
        model.router.calibration.copy_(torch.linspace(0, 1, 101, dtype=torch.float64))
        model.router.price.fill_(0.25)
    config = hf_config(args, eod_id=EOD)
    assert (config.router_hidden, config.router_chunk_size) == (8, 4)
    hf_model(config, megatron_to_hf(model.state_dict(), config)).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    back = hf_to_megatron(loaded.state_dict(), loaded.config)
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    assert router_args(loaded.config) == {"hidden": 8, "chunk_size": 4, "layers": 1}  # the run's router, read back


def test_transformer_exports_to_stock_llama(single_process_parallel, tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(5)
    args = tiny_args("transformer")
    megatron = megatron_model(args)
    converted(megatron, args).save_pretrained(tmp_path)
    llama = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()  # no remote code
    assert not (tmp_path / "modeling_oryx.py").exists()
    ids = torch.randint(0, 256, (2, 100))
    with torch.no_grad():
        assert (llama(ids).logits - megatron(ids)).abs().max() <= 1e-5


def test_layout_names_what_it_cannot_place(single_process_parallel):
    args = tiny_args("oryx_tg")
    config = hf_config(args)
    state = dict(build_model(args, transformer_config(args)).state_dict())
    state["decoder.layers.0.mixer.router.weight"] = torch.zeros(2, 64)  # a model part the layout does not know yet
    with pytest.raises(LayoutError, match=r"megatron parameter 'decoder.layers.0.mixer.router.weight' has no "
                                          r"counterpart in the weight layout \(oryx_megatron/hf/layout.py\)"):
        megatron_to_hf(state, config)
    weights = megatron_to_hf({k: v for k, v in state.items() if "router" not in k}, config)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(LayoutError, match=r"hf parameter 'model.layers.1.mlp.up_proj.weight' is missing"):
        hf_to_megatron(weights, config)
    config.rope_theta = 500000.0  # every mixer field has its place in a recipe (one schema): it comes back
    assert model_args(config).rotary_base == 500000.0
    config.mixers = "attention+lstm"
    with pytest.raises(ValueError, match=r"OryxHFConfig.mixers: mixers='attention\+lstm': unknown mixer 'lstm'"):
        config._check()
