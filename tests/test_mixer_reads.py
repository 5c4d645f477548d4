"""What a MultiMixer computes only where it is read, its static inference cache, the K/V gates
and selective recomputation (fp64 where exactness is claimed)."""

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.mixer import MixerContext
from oryx_megatron.mixer import context as mixer_context
from oryx_megatron.mixer import state as mixer_state
from oryx_megatron.models.params import mixer_parameter_counts
from oryx_megatron.ops import causal_attention
from tests.helpers import build_mixer, from_outside, mix
from tests.test_multi_mixer import (
    FAMILIES,
    HIDDEN,
    B,
    hidden_states,
    random_modes,
    run_decode,
    run_parallel,
)

pytestmark = pytest.mark.usefixtures("single_process_parallel")

LONG, QUERY_BLOCK = 72, 16  # several query blocks, the last one partial


def long_modes(seed, chunk, p_attention):
    g = torch.Generator().manual_seed(seed)
    per_chunk = (torch.rand(B, -(-LONG // chunk), generator=g) < p_attention).to(torch.int8)  # 1 = attention
    return per_chunk.repeat_interleave(chunk, dim=1)[:, :LONG]


def loss_and_grads(mixer, x, modes):
    x = x.clone().requires_grad_()
    out = run_parallel(mixer, x, modes)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * w).sum().backward()
    grads = {name: p.grad.clone() for name, p in mixer.named_parameters() if p.grad is not None}
    mixer.zero_grad(set_to_none=True)
    return out.detach(), x.grad, grads


def dense_attention(mixer, monkeypatch):
    """Make the mixer compute attention at every position (the computation before block sparsity)."""
    monkeypatch.setattr(mixer.core_attention, "forward",
                        lambda q, k, v, read=None, document_ids=None: causal_attention(q, k, v, document_ids=document_ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk,p_attention", [(16, 0.5), (12, 0.3), (16, 0.0), (16, 1.0)])
def test_attention_only_where_read_equals_dense_with_gradients(family, chunk, p_attention, monkeypatch):
    monkeypatch.setattr(mixer_context, "QUERY_BLOCK", QUERY_BLOCK)
    mixer = build_mixer(family)
    x, modes = hidden_states(20, s=LONG), long_modes(21, chunk, p_attention)
    sparse = loss_and_grads(mixer, x, modes)
    dense_attention(mixer, monkeypatch)
    dense = loss_and_grads(mixer, x, modes)
    assert (sparse[0] - dense[0]).abs().max() < 1e-12
    assert (sparse[1] - dense[1]).abs().max() < 1e-12
    assert sparse[2].keys() == dense[2].keys()
    for name in dense[2]:
        assert (sparse[2][name] - dense[2][name]).abs().max() < 1e-12, name


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", list(Mode))
def test_a_mode_value_reads_only_that_mixer(family, mode, monkeypatch):
    """Passing a Mode equals passing it for every token, and runs only that mode's mixer."""
    mixer = build_mixer(family)
    x = hidden_states(22)
    want = run_parallel(mixer, x, torch.full((B, x.shape[0]), int(mode), dtype=torch.int8))
    calls = []
    for name, module in ((Mode.ATTENTION, mixer.core_attention), (Mode.LINEAR, mixer.linear_mixer)):
        def spy(*args, _forward=module.forward, _name=name, **kwargs):
            calls.append(_name)
            return _forward(*args, **kwargs)
        monkeypatch.setattr(module, "forward", spy)
    assert (run_parallel(mixer, x, mode) - want).abs().max() < 1e-12
    assert calls == [mode]


@pytest.mark.parametrize("family", FAMILIES)
def test_decode_with_mode_values_equals_per_token_modes(family):
    mixer = build_mixer(family)
    x = hidden_states(23)
    modes = torch.full((B, x.shape[0]), int(Mode.ATTENTION), dtype=torch.int8)
    modes[:, 17:] = Mode.LINEAR
    want = run_decode(mixer, x, modes, prefill=9)
    cache = mixer.allocate_inference_cache(B, torch.float64)
    outs = [mix(mixer, x[:9], Mode.ATTENTION, cache)]
    outs += [mix(mixer, x[t : t + 1], Mode(int(modes[0, t])), cache) for t in range(9, x.shape[0])]
    assert (torch.cat(outs) - want).abs().max() < 1e-12


# ---- the static cache ----

@pytest.mark.parametrize("family", FAMILIES)
def test_cache_grows_in_blocks_and_keeps_its_tokens(family, monkeypatch):
    monkeypatch.setattr(mixer_state, "KV_BLOCK", 8)
    mixer = build_mixer(family)
    x, modes = hidden_states(24), random_modes(25, chunk=4)
    cache = mixer.allocate_inference_cache(B, torch.float64, capacity=5)
    assert cache.capacity == 8 and cache.nbytes()["kv"] == 2 * B * 8 * mixer.num_heads * mixer.d_k * 8
    outs = [mix(mixer, x[:11], modes[:, :11], cache)]  # prefill past the capacity
    assert cache.capacity == 16 and cache.seqlen == 11 and int(cache.position) == 11
    key = cache.key
    outs += [mix(mixer, x[t : t + 1], modes[:, t], cache) for t in range(11, 16)]
    assert cache.key is key  # decode writes in place
    assert cache.reserve(17) and cache.capacity == 24 and not cache.reserve(20)
    outs += [mix(mixer, x[t : t + 1], modes[:, t], cache) for t in range(16, x.shape[0])]
    assert (torch.cat(outs) - run_parallel(mixer, x, modes)).abs().max() < 1e-9


@pytest.mark.parametrize("family", FAMILIES)
def test_snapshot_restore_continues_exactly(family):
    mixer = build_mixer(family)
    x, modes = hidden_states(26), random_modes(27, chunk=4)
    cache = mixer.allocate_inference_cache(B, torch.float64)
    mix(mixer, x[:10], modes[:, :10], cache)
    snap = cache.snapshot()
    first = [mix(mixer, x[t : t + 1], modes[:, t], cache) for t in range(10, 15)]
    other = hidden_states(28)  # different tokens overwrite every state
    mix(mixer, other[:4], Mode.LINEAR, cache)
    cache.restore(snap)
    assert cache.seqlen == 10 and int(cache.position) == 10
    again = [mix(mixer, x[t : t + 1], modes[:, t], cache) for t in range(10, 15)]
    assert torch.equal(torch.cat(first), torch.cat(again))


@pytest.mark.parametrize("family", FAMILIES)
def test_no_kv_cache_linear_only(family):
    mixer = build_mixer(family)
    x = hidden_states(29)
    linear = torch.full((B, x.shape[0]), int(Mode.LINEAR), dtype=torch.int8)
    want = run_decode(mixer, x, linear, prefill=7)
    cache = mixer.allocate_inference_cache(B, torch.float64, kv_cache=False)
    assert cache.key is None and cache.nbytes()["kv"] == 0
    outs = [mix(mixer, x[:7], linear[:, :7], cache)]
    outs += [mix(mixer, x[t : t + 1], Mode.LINEAR, cache) for t in range(7, x.shape[0])]
    assert (torch.cat(outs) - want).abs().max() < 1e-12
    with pytest.raises(ValueError, match="no KV cache.*linear-only schedule"):
        mix(mixer, x[:1], Mode.ATTENTION, cache)
    with pytest.raises(ValueError, match="no KV cache"):
        mix(mixer, x[:5], random_modes(30)[:, :5].fill_(Mode.ATTENTION), cache)


# ---- K/V gates ----

@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kv_gate,chunk", [("silu", None), ("sigmoid", 4)])
def test_kv_gate_parallel_equals_decode(family, kv_gate, chunk):
    """The gates in the decode step (``OryxMixer.step``) as in the parallel forward: random per-token modes, and
    chunks of 4."""
    mixer = build_mixer(family, kv_gate=kv_gate)
    x, modes = hidden_states(31), random_modes(32, chunk=chunk)
    assert (run_decode(mixer, x, modes, prefill=11) - run_parallel(mixer, x, modes)).abs().max() < 1e-9


def test_kv_gate_multiplies_keys_and_values_and_is_shared():
    plain, gated = build_mixer("oryx_tg"), build_mixer("oryx_tg", kv_gate="sigmoid")
    assert set(gated.layout.streams) - set(plain.layout.streams) == {"k_gate", "v_gate"}
    extra = plain.num_heads * (plain.d_k + plain.d_v) * HIDDEN  # the gates' rows of in_proj
    p, g = mixer_parameter_counts(plain), mixer_parameter_counts(gated)
    assert g["shared"] - p["shared"] == extra and g["attention"] == p["attention"] and g["linear"] == p["linear"]
    x, modes = hidden_states(33), random_modes(34, chunk=4)
    assert (run_parallel(plain, x, modes) - run_parallel(gated, x, modes)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="kv_gate='tanh'"):
        build_mixer("oryx_tg", kv_gate="tanh")


# ---- selective recomputation ----

@pytest.mark.parametrize("family", FAMILIES)
def test_selective_recompute_same_gradients_less_saved(family):
    x, modes = hidden_states(35, s=64), random_modes(36)[:, :1].expand(B, 64).contiguous()
    results, saved = {}, {}
    for granularity in (None, "selective"):
        mixer = build_mixer(family, parallel=dict(recompute_granularity=granularity))
        sizes = []

        def pack(t):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            results[granularity] = loss_and_grads(mixer, x, modes)
        saved[granularity] = sum(sizes)
    base, recomputed = results[None], results["selective"]
    assert torch.equal(base[0], recomputed[0]) and torch.equal(base[1], recomputed[1])
    for name in base[2]:
        assert torch.equal(base[2][name], recomputed[2][name]), name
    if from_outside(family):  # the memory it saves depends on what its own ops keep: the package's mixers' claim
        return
    # the checkpointed mixing keeps its input alive outside the hooks: the projected streams
    kept_streams = x.shape[0] * B * mixer.num_heads * mixer.layout.width * x.element_size()
    assert saved["selective"] + kept_streams < 0.5 * saved[None]


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_inputs_have_a_unit_stride_in_the_head_dim_and_the_activation_dtype(family, monkeypatch):
    """SDPA takes its flash kernels only for q, k, v of a unit last-dim stride in a half dtype;
    convolved keys and values used to arrive channel-major and sent every Oryx layer to the math
    path, and an fp32 rotation would do the same in bf16 training."""
    import torch.nn.functional as F

    from oryx_megatron.ops import attention

    seen, sdpa = [], F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.extend((t.stride(-1), t.dtype) for t in (q, k, v))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    mixer = build_mixer(family, dtype=torch.bfloat16)
    run_parallel(mixer, hidden_states(37).to(torch.bfloat16), Mode.ATTENTION)
    assert seen and set(seen) == {(1, torch.bfloat16)}


@pytest.mark.parametrize("granularity", [None, "selective"])
def test_the_layers_of_a_forward_read_their_modes_with_one_host_sync(granularity, monkeypatch):
    """Which modes are read (torch.unique, then a copy to the host) is derived once per forward, in its
    MixerContext, not once per layer, nor again when the backward recomputes a layer."""
    layers = [build_mixer("oryx_tg", seed=i, parallel=dict(recompute_granularity=granularity)) for i in range(3)]
    x, modes = hidden_states(38).requires_grad_(), random_modes(39, chunk=4)
    calls, unique = [], torch.unique
    monkeypatch.setattr(torch, "unique", lambda *a, **k: calls.append(1) or unique(*a, **k))
    context = MixerContext.build(layers[0].config, modes)
    h = x
    for layer in layers:
        h = h + layer(h, context)[0]
    h.sum().backward()
    assert len(calls) == 1
