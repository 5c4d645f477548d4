"""Layer patterns (``model.layer_pattern``, docs/model.md "Layer patterns"): every family is its pattern, each letter
builds its layer, only the Oryx blocks read the tokens' modes, and a model of every kind of layer (``PATTERN``)
keeps the invariants in fp64: cached generation == the parallel forward under every schedule, packed documents ==
each document alone, linear-only inference without the Oryx blocks' KV caches. TP, CP and PP: the pattern cases of
tests/test_tensor_parallel.py, tests/test_context_parallel.py and tests/test_layout_gradients.py; the Hugging Face
model: tests/test_hf.py."""

import re

import pytest
import torch

from oryx_megatron.config import MixerConfigError, Mode, RouterConfig, RouterConfigError
from oryx_megatron.config.router import check_router
from oryx_megatron.eval.ppl import attention_reads
from oryx_megatron.hf.configuration import OryxHFConfig
from oryx_megatron.inference import generate
from oryx_megatron.mixer import MixerContext
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.run_config import ConfigError
from tests.helpers import PATTERN, build_mixer, tiny_args
from tests.test_generation import MAX_NEW, VOCAB, assert_cached_generation_equals_recompute, prompts
from tests.test_train import run_config

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")


def model_of(family, seed=0, **overrides):
    args = tiny_args(family, **overrides)
    torch.manual_seed(seed)
    return build_model(args, transformer_config(args, params_dtype=torch.float64)).eval()


def random_modes(b=2, s=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (b, s // 4), generator=g).repeat_interleave(4, 1)


@pytest.fixture(scope="module")
def pattern_model(single_process_parallel):
    return model_of(PATTERN)


@pytest.mark.parametrize("family,letter", [("oryx_tg", "O"), ("oryx_tm", "O"), ("gdn", "G"), ("mamba2", "M")])
def test_every_family_is_its_pattern(family, letter):
    """A family's model and the pattern of its letter at every layer: the same weights, the same logits."""
    plain, patterned = model_of(family), model_of(family, layer_pattern=f"{letter} {letter}")
    assert plain.state_dict().keys() == patterned.state_dict().keys()
    pairs = zip(plain.state_dict().values(), patterned.state_dict().values())
    tensors = [(a, b) for a, b in pairs if torch.is_tensor(a)]
    assert tensors and all(torch.equal(a, b) for a, b in tensors)
    ids = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        assert torch.equal(plain(ids, random_modes()), patterned(ids, random_modes()))


def test_each_letter_builds_its_layer(pattern_model):
    """O*MG: an Oryx-TM block, attention alone, Mamba-2 alone, GDN alone; each single-mixer layer is the family's
    layer (its mixer loads the family's mixer's weights strictly and computes the same)."""
    mixers = [layer.mixer for layer in pattern_model.decoder.layers]
    assert [m.config.mixers for m in mixers] == ["attention+mamba2", "attention", "mamba2", "gdn"]
    assert [m.linear_mixer is None for m in mixers] == [False, True, False, False]
    assert [m.layout.attention_query for m in mixers] == ["q_attn", "q_attn", None, None]
    x = torch.randn(24, 2, 64, dtype=torch.float64)
    for mixer, family in zip(mixers[2:], ["mamba2", "gdn"]):
        alone = build_mixer(family, seed=1)
        alone.load_state_dict(mixer.state_dict(), strict=True)
        with torch.no_grad():
            got = mixer(x, MixerContext.build(pattern_model.config, random_modes()).read_by(mixer.config))[0]
            assert torch.equal(got, alone(x, MixerContext.build(alone.config))[0])


def test_only_the_oryx_blocks_read_the_modes(pattern_model):
    ids = torch.randint(0, VOCAB, (2, 24))
    seen = []
    hooks = [layer.mixer.register_forward_pre_hook(lambda _m, args: seen.append(args[1].modes))
             for layer in pattern_model.decoder.layers]
    try:
        with torch.no_grad():
            attention, linear = (pattern_model(ids, torch.full((2, 24), mode)) for mode in Mode)
    finally:
        for hook in hooks:
            hook.remove()
    assert (attention - linear).abs().max() > 1e-3  # its Oryx block reads them
    assert seen[1:4] == [Mode.ATTENTION, Mode.LINEAR, Mode.LINEAR]  # the other layers read their own mixer
    hybrid = model_of("mamba2 MMM*")  # no Oryx block: the modes change nothing, and none are needed
    with torch.no_grad():
        assert torch.equal(hybrid(ids), hybrid(ids, random_modes()))


@pytest.mark.parametrize("schedule", ["all_attention", "all_linear", "prefill=linear decode=attention",
                                      "attention:0-7,linear:7-"])
@pytest.mark.parametrize("pattern", [PATTERN, "oryx_tg GGGO GGGO"])
def test_cached_generation_equals_parallel_recompute(pattern, schedule):
    """Every kind of layer's cache (KV for attention, states for M and G, both for O) through prefill and decode."""
    assert_cached_generation_equals_recompute(model_of(pattern), schedule)


def test_linear_only_inference_drops_the_oryx_blocks_kv_caches_only(pattern_model):
    """kv_cache=False: the Oryx block keeps no keys and values, the attention layer keeps its own (it reads nothing
    else); the tokens are those of all_linear with every cache."""
    batch = prompts()
    kept = generate(pattern_model, batch, "all_linear", MAX_NEW, vocab_size=VOCAB)
    dropped = generate(pattern_model, batch, "all_linear", MAX_NEW, vocab_size=VOCAB, kv_cache=False)
    assert dropped.tokens == kept.tokens
    caches = pattern_model.allocate_inference_cache(1, torch.float64, kv_cache=False)
    assert [cache.key is not None for cache in caches] == [False, True, False, False]


def test_packed_documents_read_as_each_alone(pattern_model):
    lengths = (7, 13, 4)
    ids, modes = torch.randint(0, VOCAB, (1, sum(lengths))), random_modes(1, 24)
    document_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    with torch.no_grad():
        packed = pattern_model(ids, modes, document_ids=document_ids)
        start = 0
        for n in lengths:
            alone = pattern_model(ids[:, start:start + n], modes[:, start:start + n])
            assert (packed[:, start:start + n] - alone).abs().max() < 1e-9
            start += n


def test_forward_backward_reaches_every_parameter():
    model = model_of(PATTERN).train()
    ids = torch.randint(0, VOCAB, (2, 25))
    model(ids[:, :-1], random_modes(), labels=ids[:, 1:]).sum().backward()
    assert [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


@pytest.mark.parametrize("fields,message", [
    (dict(layer_pattern="O*X*"), "layer_pattern='O*X*': unknown letter 'X'; expected one of M G * O"),
    (dict(layer_pattern="O*M"), "layer_pattern='O*M' has 3 layers; the model has num_layers=4"),
    (dict(layer_pattern="OO||OO"), "a pipeline segment without layers"),
    (dict(family="gdn", layer_pattern="GGOG"), "an Oryx block ('O') reads two mixers; mixers='gdn' has one"),
    (dict(family="transformer", layer_pattern="**M*"), "family 'transformer' is megatron's GPTModel"),
])
def test_a_bad_pattern_is_one_line_that_names_it(fields, message):
    with pytest.raises(MixerConfigError, match=re.escape(message)) as error:
        tiny_args(fields.pop("family", "oryx_tg"), num_layers=4, **fields)
    assert error.value.field == "layer_pattern" and "\n" not in str(error.value)


def test_run_configs_name_the_pattern(corpus, tmp_path):
    with pytest.raises(ConfigError, match=r"config key 'model.layer_pattern': layer_pattern='OOO\|O\|OO' splits "
                                          r"the layers into 3 pipeline segments at '\|'; the run has 2 pipeline"):
        run_config(corpus, tmp_path, "model.num_layers=6", "model.layer_pattern='OOO|O|OO'",
                   "parallel.pipeline_model_parallel_size=2")
    with pytest.raises(ConfigError, match="config key 'model.layer_pattern': layer_pattern='OO' has 2 layers; the "
                                          "model has num_layers=4"):
        run_config(corpus, tmp_path, "model.num_layers=4", "model.layer_pattern=OO")


def test_the_router_reads_oryx_blocks_only():
    args = tiny_args(PATTERN)
    check_router(RouterConfig(hidden=8, layers=1), args, 4)  # the first layer is an Oryx block
    with pytest.raises(RouterConfigError, match=r"router.layers=2: the router reads the model's first layers, which "
                                                r"must be Oryx blocks \('O'\); layer_pattern='O\*MG' begins 'O\*'"):
        check_router(RouterConfig(hidden=8, layers=2), args, 4)


def test_the_hf_config_counts_the_pattern_against_its_layers():
    with pytest.raises(ValueError, match=r"OryxHFConfig.layer_pattern: layer_pattern='O\*' has 2 layers; the model "
                                         r"has num_hidden_layers=4"):
        OryxHFConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, head_dim=16,
                     mixers="attention+gdn", layer_pattern="O*")


@pytest.mark.parametrize("family,reads", [("mamba2 MMM*", 0.25), ("oryx_tm MMMO", 0.3 / 4), ("oryx_tm", 0.3),
                                          ("gdn", 0.0), ("transformer", 1.0)])
def test_attention_reads_count_each_layer_as_it_reads(family, reads):
    """E4's attention compute: of every layer's reads, the share in attention when 30% of the tokens' modes read it."""
    assert attention_reads(model_of(family), 0.3) == pytest.approx(reads)
