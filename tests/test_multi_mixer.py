"""THE invariant: the parallel forward equals step-by-step decode for any mode pattern (fp64), for attention with
every registered linear mixer (tests/helpers.py ``linear_families``: the package's, and the tests' GLA)."""

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.mixer.context import MixerContext
from oryx_megatron.models.params import mixer_parameter_counts
from tests.helpers import build_mixer, family_cases, linear_families, linear_mixer_of, mix

pytestmark = pytest.mark.usefixtures("single_process_parallel")

B, S, HIDDEN = 2, 29, 64  # S is not a multiple of the kernel chunk (8)
FAMILIES = linear_families()


def random_modes(seed, chunk=None):
    g = torch.Generator().manual_seed(seed)
    if chunk is None:
        return torch.randint(0, 2, (B, S), generator=g, dtype=torch.int8)
    per_chunk = torch.randint(0, 2, (B, -(-S // chunk)), generator=g, dtype=torch.int8)
    return per_chunk.repeat_interleave(chunk, dim=1)[:, :S]


def hidden_states(seed=0, s=S):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(s, B, HIDDEN, generator=g, dtype=torch.float64)


def run_parallel(mixer, x, modes):
    return mix(mixer, x, modes)


def step(mixer, hidden, modes, cache):
    """``OryxMixer.step``: one token per sequence, hidden [b, hidden], modes [b] -> [b, hidden]."""
    return mixer(hidden, MixerContext.build(mixer.config, modes[:, None], decode=True), cache)[0]


def run_decode(mixer, x, modes, prefill=0):
    """Prefill the first `prefill` tokens (at least one) with the parallel path, then decode one token at a time:
    ``OryxMixer.step`` on [b, hidden] (counted: each later token is one step)."""
    cache = mixer.allocate_inference_cache(B, torch.float64)
    prefill, steps, step = max(prefill, 1), [], mixer.step
    mixer.step = lambda *args, **kwargs: steps.append(1) or step(*args, **kwargs)
    try:
        outs = [mix(mixer, x[:prefill], modes[:, :prefill], cache)]
        outs += [mix(mixer, x[t : t + 1], modes[:, t], cache) for t in range(prefill, x.shape[0])]
    finally:
        del mixer.step
    assert cache.seqlen == x.shape[0] and len(steps) == x.shape[0] - prefill
    return torch.cat(outs, dim=0)


@pytest.mark.parametrize("family,chunk", family_cases(None, 4, 16, ids=["per-token", "chunk4", "chunk16"]))
def test_parallel_forward_equals_step_by_step_decode(family, chunk):
    """Per-token (random modes), chunks of 4 and of 16: every token after the first is one ``OryxMixer.step``."""
    mixer = build_mixer(family)
    x, modes = hidden_states(), random_modes(1, chunk)
    ref = run_parallel(mixer, x, modes)
    assert (run_decode(mixer, x, modes) - ref).abs().max() < 1e-9


@pytest.mark.parametrize("family,prefill", family_cases(13, 1, 8, 28))
def test_prefill_then_decode_equals_parallel(family, prefill):
    mixer = build_mixer(family)
    x, modes = hidden_states(2), random_modes(3, chunk=4)
    ref = run_parallel(mixer, x, modes)
    assert (run_decode(mixer, x, modes, prefill=prefill) - ref).abs().max() < 1e-9


@pytest.mark.parametrize("family", FAMILIES)
def test_sequences_in_pages_at_different_positions_decode_as_each_alone(family):
    """A serving engine: keys and values in a pool of pages (``MixerCache.block_table``, pages in no order, some
    idle), each sequence prefilled in two chunks into its own pages, then sequences at positions 5 and 17 step
    together with modes of their own: every output equals the sequence's own run in a cache of its own."""
    mixer, x, modes = build_mixer(family), hidden_states(7), random_modes(8)
    starts, steps, page = (5, 17), 8, 4
    pages_each = -(-(max(starts) + steps) // page)
    tables = torch.randperm(2 * pages_each + 3, generator=torch.Generator().manual_seed(9))[: 2 * pages_each]
    tables = tables.view(2, pages_each)  # 3 pages idle
    pool = mixer.allocate_inference_cache(2 * pages_each + 3, torch.float64, capacity=page)
    pool = None if pool.key is None else (pool.key[:, :page].clone(), pool.value[:, :page].clone())

    def cache(batch, table):
        c = mixer.allocate_inference_cache(batch, torch.float64)
        if pool is not None:
            c.key, c.value, c.block_table = *pool, table
        return c

    alone, paged, caches = [], [], []
    for i, start in enumerate(starts):
        own, in_pages = mixer.allocate_inference_cache(1, torch.float64), cache(1, tables[i : i + 1])
        for c, outs in ((own, alone), (in_pages, paged)):
            first = [mix(mixer, x[a:b, i : i + 1], modes[i : i + 1, a:b], c) for a, b in ((0, 3), (3, start))]
            outs.append([torch.cat(first)])
        alone[i] += [step(mixer, x[t, i : i + 1], modes[i : i + 1, t], own)[None] for t in range(start, start + steps)]
        caches.append(in_pages)
    shared = cache(2, tables)
    shared.conv_state.copy_(torch.cat([c.conv_state for c in caches]))
    for name, state in shared.recurrent_state.items():
        state.copy_(torch.cat([c.recurrent_state[name] for c in caches]))
    shared.position, shared.seqlen = torch.tensor(starts), max(starts)
    for k in range(steps):
        rows = torch.stack([x[start + k, i] for i, start in enumerate(starts)])  # [2, hidden]
        out = step(mixer, rows, torch.stack([modes[i, start + k] for i, start in enumerate(starts)]), shared)
        for i in range(2):
            paged[i].append(out[None, i : i + 1])
    for i in range(2):
        assert (torch.cat(paged[i]) - torch.cat(alone[i])).abs().max() < 1e-12
    assert shared.position.tolist() == [start + steps for start in starts]
    if pool is not None:
        idle = sorted(set(range(2 * pages_each + 3)) - set(tables.flatten().tolist()))
        assert len(idle) == 3 and pool[0][idle].abs().max() == 0  # pages of no sequence are left alone


@pytest.mark.parametrize("family", FAMILIES)
def test_linear_prefill_then_attention_answer(family):
    """The paper's mixed mode: a long context read linearly, the answer with attention."""
    mixer = build_mixer(family)
    x = hidden_states(4)
    modes = torch.zeros(B, S, dtype=torch.int8)
    modes[:, 24:] = Mode.ATTENTION
    ref = run_parallel(mixer, x, modes)
    assert (run_decode(mixer, x, modes, prefill=24) - ref).abs().max() < 1e-9


@pytest.mark.parametrize("family", FAMILIES)
def test_each_token_reads_its_modes_mixer_over_all_earlier_tokens(family):
    """Both memories absorb every token: a mixed run equals, token by token, the
    single-mode run of the token's own mode."""
    mixer = build_mixer(family)
    x, modes = hidden_states(5), random_modes(6)
    ones = torch.ones(B, S, dtype=torch.int8)
    all_attention = run_parallel(mixer, x, ones * Mode.ATTENTION)
    all_linear = run_parallel(mixer, x, ones * Mode.LINEAR)
    expected = torch.where((modes == Mode.ATTENTION).T[:, :, None], all_attention, all_linear)
    assert (run_parallel(mixer, x, modes) - expected).abs().max() < 1e-12
    assert (all_attention - all_linear).abs().max() > 1e-3  # the two mixers do differ


def copy_weights(src, dst, same_as=None):
    """Give `dst` the weights of `src` that it has: its input-projection rows stream by stream,
    every other parameter by name. `same_as` maps a stream of dst to the src stream it copies."""
    same_as = same_as or {}
    h, hidden = src.num_heads, src.config.hidden_size
    streams = src.layout.streams
    rows = dict(zip(streams, src.in_proj.weight.view(h, -1, hidden).split(list(streams.values()), 1)))
    params = dict(src.named_parameters())
    params.update({f"conv_{dst_name}.weight": params[f"conv_{src_name}.weight"] for dst_name, src_name in same_as.items()})
    with torch.no_grad():
        for name, param in dst.named_parameters():
            if name == "in_proj.weight":
                param.copy_(torch.cat([rows[same_as.get(n, n)] for n in dst.layout.streams], dim=1).view(-1, hidden))
            else:
                param.copy_(params[name])


@pytest.mark.parametrize(
    "family,single,mode",
    [*((family, linear_mixer_of(family), Mode.LINEAR) for family in FAMILIES),
     ("oryx_tg", "attention", Mode.ATTENTION)],
)
def test_single_mode_equals_the_single_mixer_layer(family, single, mode):
    multi = build_mixer(family)
    alone = build_mixer(family, seed=1, mixers=single)
    assert alone.config.mixer_list == (single,)
    copy_weights(multi, alone)
    x = hidden_states(7)
    modes = torch.full((B, S), int(mode), dtype=torch.int8)
    assert (run_parallel(multi, x, modes) - run_parallel(alone, x, None)).abs().max() < 1e-12


def test_multi_mixer_requires_modes():
    mixer = build_mixer("oryx_tg")
    with pytest.raises(ValueError, match=r"modes \[batch, seq\] is required .*attention\+gdn"):
        mix(mixer, hidden_states(), None)


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_forward_matches_float64(family):
    mixer64 = build_mixer(family)
    mixer32 = build_mixer(family, dtype=torch.float32)
    x, modes = hidden_states(8), random_modes(9, chunk=4)
    out32 = run_parallel(mixer32, x.float(), modes)
    assert out32.dtype == torch.float32
    assert (out32.double() - run_parallel(mixer64, x, modes)).abs().max() < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_query_parallel_forward_equals_decode(family):
    mixer = build_mixer(family, shared_query=True)
    assert "q_attn" not in mixer.layout.streams and not hasattr(mixer, "conv_q_attn")
    x, modes = hidden_states(10), random_modes(11, chunk=4)
    assert (run_decode(mixer, x, modes, prefill=13) - run_parallel(mixer, x, modes)).abs().max() < 1e-9


def test_shared_query_attention_reads_with_the_linear_query():
    """A separate-query mixer whose attention query equals its convolved linear query (conv
    on, same weights) computes what the shared-query mixer computes."""
    shared = build_mixer("oryx_tg", shared_query=True)
    separate = build_mixer("oryx_tg", seed=1, attention_query_conv=True)
    copy_weights(shared, separate, same_as={"q_attn": "q_lin"})
    x, modes = hidden_states(12), random_modes(13, chunk=4)
    assert (run_parallel(separate, x, modes) - run_parallel(shared, x, modes)).abs().max() < 1e-12
    counts = mixer_parameter_counts(shared)
    # linear-only: the beta and alpha rows of in_proj, A_log and dt_bias; the query is shared now
    assert counts["attention"] == 0 and counts["linear"] == shared.num_heads * (2 * HIDDEN + 2)

