"""OryxModel end to end on CPU: forward/backward, decode with caches, config errors."""

import dataclasses

import pytest
import torch

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.models.builder import build_model, padded_vocab_size, transformer_config
from tests.helpers import tiny_args

pytestmark = pytest.mark.usefixtures("single_process_parallel")


def tiny_model(family, dtype=torch.float32, seed=0):
    args = tiny_args(family)
    torch.manual_seed(seed)
    return build_model(args, transformer_config(args, params_dtype=dtype)), args


def batch(args, b=2, s=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (b, s + 1), generator=g)
    modes = torch.randint(0, 2, (b, -(-s // 8)), generator=g, dtype=torch.int8).repeat_interleave(8, 1)
    return ids[:, :-1], ids[:, 1:], modes[:, :s]


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer"])
def test_forward_backward_reaches_every_parameter(family):
    model, args = tiny_model(family)
    tokens, labels, modes = batch(args)
    loss = model(tokens, modes, labels=labels)
    assert loss.shape == tokens.shape
    # At initialisation the loss is close to uniform over the (padded) vocab.
    assert abs(loss.mean().item() - torch.log(torch.tensor(128.0)).item()) < 0.5
    loss.mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"no gradient reaches {name}"


SSM_SCALARS = {"oryx_tg": ("A_log", "dt_bias"), "oryx_tm": ("A_log", "dt_bias", "D"), "gdn": ("A_log", "dt_bias"),
               "mamba2": ("A_log", "dt_bias", "D"), "transformer": ()}


@pytest.mark.parametrize("family", SSM_SCALARS)
def test_bf16_models_keep_the_ssm_scalars_in_fp32(family):
    """Under params_dtype=bf16 every weight is bf16 but A_log, dt_bias and D, which stay fp32 (their
    init values exactly: no 8-bit rounding) through a forward and backward."""
    model, args = tiny_model(family, dtype=torch.bfloat16)
    reference, _ = tiny_model(family, dtype=torch.float32)
    scalars = {n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in SSM_SCALARS[family]}
    assert len(scalars) == args.num_layers * len(SSM_SCALARS[family])
    fp32_weights = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if name in scalars else torch.bfloat16), name
        if name in scalars:
            assert torch.equal(p, fp32_weights[name]), name
    tokens, labels, modes = batch(args)
    model(tokens, modes, labels=labels).float().mean().backward()
    assert all(model.get_parameter(n).grad.dtype == torch.float32 for n in scalars)


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm", "transformer"])
def test_model_decode_with_cache_equals_parallel_logits(family):
    model, args = tiny_model(family, dtype=torch.float64)
    model.eval()  # the Transformer decodes in eval mode
    tokens, _, modes = batch(args, s=17)
    logits = model(tokens, modes)
    cache = model.allocate_inference_cache(tokens.shape[0], torch.float64)
    prefill = model(tokens[:, :9], modes[:, :9], inference_cache=cache)
    steps = [model(tokens[:, t : t + 1], modes[:, t : t + 1], inference_cache=cache) for t in range(9, 17)]
    assert (torch.cat([prefill] + steps, dim=1) - logits).abs().max() < 1e-9


def test_modes_change_the_output_of_a_multi_mixer_model_only():
    oryx, args = tiny_model("oryx_tg")
    gdn, _ = tiny_model("gdn")
    tokens, _, modes = batch(args)
    with torch.no_grad():
        assert (oryx(tokens, modes) - oryx(tokens, 1 - modes)).abs().max() > 1e-3
        assert torch.equal(gdn(tokens, modes), gdn(tokens, 1 - modes))


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(mixers="attention+lstm"), r"mixers='attention\+lstm'"),
        (dict(mixers="gdn+mamba2"), r"mixers='gdn\+mamba2': at most one linear mixer"),
        (dict(mixer_conv_activation="relu"), r"mixer_conv_activation='relu'"),
        (dict(kv_channels=15), r"kv_channels=15 must be even"),
        (dict(tensor_model_parallel_size=3), r"num_attention_heads \(4\) must be a multiple of tensor_model_parallel_size \(3\)"),
        (dict(transformer_impl="apex"), r"transformer_impl='apex'"),
        (dict(mixers="gdn", shared_query=True), r"shared_query=True needs two mixers .*mixers='gdn'"),
    ],
)
def test_invalid_config_names_the_field(fields, message):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, kv_channels=16)
    with pytest.raises(ValueError, match=message):
        OryxConfig(**{**base, **fields})


def test_unknown_family_and_vocab_padding_errors():
    with pytest.raises(ValueError, match=r"model.family='rwkv'"):
        transformer_config(tiny_args("rwkv"))
    args = tiny_args("oryx_tg", vocab_size=97)
    assert padded_vocab_size(args) == 128
    assert padded_vocab_size(dataclasses.replace(args, make_vocab_size_divisible_by=1), 1) == 97
    with pytest.raises(ValueError, match=r"make_vocab_size_divisible_by=1: padded vocab 97 .* tensor_model_parallel_size=2"):
        padded_vocab_size(dataclasses.replace(args, make_vocab_size_divisible_by=1), 2)


def test_activation_recomputation_gives_the_same_gradients(monkeypatch):
    from megatron.core import tensor_parallel

    calls = []
    checkpoint = tensor_parallel.checkpoint
    monkeypatch.setattr(tensor_parallel, "checkpoint", lambda *a: calls.append(1) or checkpoint(*a))
    args = tiny_args("oryx_tg")
    grads = []
    recomputes = ({}, dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
                  dict(recompute_granularity="selective"))
    for recompute in recomputes:
        torch.manual_seed(0)
        model = build_model(args, transformer_config(args, params_dtype=torch.float64, **recompute))
        tokens, labels, modes = batch(args)
        model(tokens, modes, labels=labels).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert len(calls) == args.num_layers  # every layer of the full-recompute model was recomputed
    for other in grads[1:]:
        assert grads[0].keys() == other.keys()
        for name in grads[0]:
            assert torch.allclose(grads[0][name], other[name], atol=1e-12), name


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_transformer_sdpa_baseline_equals_megatron_masked_softmax(dtype, tolerance):
    """The baseline's core attention (SDPA, is_causal, no mask) computes what the local spec's
    DotProductAttention computes over an explicit s x s mask: logits and gradients."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from oryx_megatron.models.builder import _gpt_block_spec
    from oryx_megatron.models.transformer import TransformerBaseline

    args = tiny_args("transformer")
    config = transformer_config(args, params_dtype=dtype)
    torch.manual_seed(0)
    sdpa = build_model(args, config)
    masked_spec = _gpt_block_spec("local", config, vp_stage=None)
    masked_spec.layer_specs[0].submodules.self_attention.submodules.core_attention = DotProductAttention  # every layer's
    masked = TransformerBaseline(config, masked_spec, vocab_size=padded_vocab_size(args),
                                 max_sequence_length=args.max_sequence_length,
                                 share_embeddings_and_output_weights=args.share_embeddings_and_output_weights)
    masked.load_state_dict(sdpa.state_dict())
    tokens, labels, _ = batch(args)
    s = tokens.shape[1]
    causal_mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]

    def masked_forward(**kwargs):
        return GPTModel.forward(masked, tokens, position_ids=None, attention_mask=causal_mask, **kwargs)

    with torch.no_grad():
        assert (sdpa(tokens) - masked_forward()).abs().max() < tolerance
    sdpa(tokens, labels=labels).sum().backward()
    masked_forward(labels=labels).sum().backward()
    masked_grads = dict(masked.named_parameters())
    for name, p in sdpa.named_parameters():
        assert (p.grad - masked_grads[name].grad).abs().max() < tolerance, name


def test_transformer_baseline_uses_sdpa_core_attention():
    from oryx_megatron.layers.gpt_attention import CausalSDPAttention

    model, _ = tiny_model("transformer")
    attentions = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert attentions and all(isinstance(a, CausalSDPAttention) for a in attentions)


@pytest.mark.parametrize("family", ["oryx_tg", "gdn"])
def test_plain_inference_forward_equals_megatrons(family):
    """Without autograd at TP=1 the token embedding, the linears and the MLP take their plain paths (layers/
    embedding.py, linear.py, mlp.py); the logits equal megatron's forward under autograd, which the plain paths
    leave to megatron, bit for bit."""
    model, args = tiny_model(family)
    tokens, _, modes = batch(args)
    assert model.embedding.solo and model.decoder.layers[0].mlp.plain
    with torch.no_grad():
        plain = model(tokens, modes)
    assert torch.equal(plain, model(tokens, modes).detach())


def test_a_rematerialised_weight_keeps_megatrons_forward(monkeypatch):
    """megatron 0.19 shards a weight over its gtp_remat group (``gtp_remat_size > 1``, rematerialised in its forward):
    the plain paths, which read the weight as it lies, are off for the embedding, the linears, the MLP and the
    Transformer baseline's cached step. Simulated
    here by the attribute megatron's constructors set."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    from oryx_megatron.layers.linear import ColumnLinear, RowLinear

    for cls in (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding):
        def remat_init(self, *args, _init=cls.__init__, **kwargs):
            _init(self, *args, **kwargs)
            self.gtp_remat_size = 2
        monkeypatch.setattr(cls, "__init__", remat_init)
    model, _ = tiny_model("oryx_tg")
    linears = [m for m in model.modules() if isinstance(m, (ColumnLinear, RowLinear))]
    assert len(linears) > 4 and not any(m.solo for m in linears)
    assert not model.embedding.solo and not model.decoder.layers[0].mlp.plain
    transformer, _ = tiny_model("transformer")
    assert not transformer.direct_step  # its cached calls go through megatron's forward
