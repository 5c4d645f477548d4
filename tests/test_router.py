"""The chunk router (layers/router.py) and router schedules (inference/routing.py): causal decisions,
the budget's quota, generation deciding chunk by chunk equal to one parallel routing pass, bad specs."""

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.data.schedules import RouterSchedule, parse_schedule
from oryx_megatron.inference import generate
from oryx_megatron.inference.routing import chunk_decisions, route_modes
from oryx_megatron.models.builder import build_model, transformer_config
from tests.helpers import tiny_args

pytestmark = pytest.mark.usefixtures("single_process_parallel")
CHUNK = 8


def routed_model(family="oryx_tg", seed=0, dtype=torch.float64, router_layers=1):
    """A tiny model with a router of random (not zero) output weights, calibrated on random tokens; it reads
    the first ``router_layers`` layers (of 2)."""
    args = tiny_args(family, router_hidden=16, router_chunk_size=CHUNK, router_layers=router_layers)
    torch.manual_seed(seed)
    model = build_model(args, transformer_config(args, params_dtype=dtype))
    with torch.no_grad():
        model.router.fc2.weight.normal_(0, 20.0)
        logits = model.route(tokens(args, 4, 64, seed=9), CHUNK)
        model.router.fc2.bias.sub_(logits.median())  # about half the chunks above p = 0.5
        probs = torch.sigmoid(logits - logits.median()).flatten()
        model.router.calibration.copy_(torch.quantile(probs, torch.linspace(0, 1, 101, dtype=torch.float64)))
    return model.eval(), args


def tokens(args, b=2, s=40, seed=1):
    return torch.randint(0, args.vocab_size, (b, s), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family,router_layers", [("oryx_tg", 1), ("oryx_tm", 1), ("oryx_tg", 2), ("oryx_tm", 2)])
def test_a_chunks_logit_reads_only_its_first_token_and_the_tokens_before(family, router_layers):
    model, args = routed_model(family, router_layers=router_layers)
    ids = tokens(args)
    with torch.no_grad():
        logits = model.route(ids, CHUNK)  # [b, 40 // 8]: chunks 0..4, starting at 0, 8, .., 32
        assert logits.shape == (2, 5) and logits.std() > 0.1
        for start in range(0, 33, CHUNK // 2):  # change every token from `start` on (32: the last chunk's first)
            changed = ids.clone()
            changed[:, start:] = (changed[:, start:] + 1) % args.vocab_size
            other = model.route(changed, CHUNK)
            decided_before = -(-start // CHUNK)  # the chunks whose first token is before `start`
            assert torch.equal(other[:, :decided_before], logits[:, :decided_before]), start
            assert (other[:, decided_before:] - logits[:, decided_before:]).abs().max() > 1e-6, start
        for start in range(CHUNK, 40, CHUNK):  # the chunk's first token alone changes its logit
            changed = ids.clone()
            changed[:, start] = (changed[:, start] + 1) % args.vocab_size
            c = start // CHUNK
            assert (model.route(changed, CHUNK)[:, c] - logits[:, c]).abs().min() > 1e-6, start


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm"])
def test_a_deeper_router_decodes_the_logits_of_its_parallel_all_linear_pass(family):
    """router_layers=2: after a prefill of 11 tokens (into the router's own caches), each chunk's logit at
    its first token (``route_step``) equals the parallel pass's over the whole sequence, the tokens between
    advancing the all-linear pass (``advance_router``); fp64."""
    model, args = routed_model(family, router_layers=2)
    ids = tokens(args, 2, 40, seed=6)
    with torch.no_grad():
        want = model.route(ids, CHUNK)  # [2, 5]
        cache = model.allocate_inference_cache(2, torch.float64)
        router_cache = model.allocate_router_cache(2, torch.float64)
        assert len(router_cache) == 2 and model.allocate_router_cache(2, torch.float64) is not None
        prefill = model.route(ids[:, :11], CHUNK, router_cache=router_cache)
        assert (prefill - want[:, :2]).abs().max() < 1e-9
        for pos in range(11, 40):
            if pos % CHUNK:
                model.advance_router(ids[:, pos : pos + 1], router_cache)
            else:
                got = model.route_step(ids[:, pos : pos + 1], cache, router_cache)
                assert (got[:, 0] - want[:, pos // CHUNK]).abs().max() < 1e-9, pos
        assert router_cache[1].seqlen == 40 and cache[0].seqlen == 0  # the model's own caches untouched


def test_the_budget_quota_holds_whatever_the_router_wants():
    model, _ = routed_model()
    decide = chunk_decisions(model, RouterSchedule(budget=0.25), batch_size=3, device="cpu")
    assert decide.threshold == max(0.5, float(model.router.calibration[75]))  # the calibrated (1 - budget) percentile
    modes = decide(torch.full((3, 40), 10.0))  # the router wants attention everywhere
    attention = (modes == Mode.ATTENTION).long()
    chunks = torch.arange(1, 41)
    assert (attention.cumsum(1) <= 0.25 * chunks + 1).all()  # budget x chunks so far + one, at every point
    assert attention.sum(1).tolist() == [11, 11, 11]  # 0.25 x 40 + 1
    assert chunk_decisions(model, RouterSchedule(threshold=0.5), 1, "cpu")(torch.tensor([[0.1, -0.1]])).tolist() == [
        [Mode.ATTENTION, Mode.LINEAR]]


def test_a_budget_never_lowers_the_threshold_below_one_half_and_saves_what_it_does_not_spend():
    """A router that wants attention on fewer chunks than the budget (its calibrated 90th percentile near 0,
    as one trained on rarer targets has): the budget's threshold stays 0.5, so the early chunks it does not
    want keep the budget, and a later burst it wants spends what they saved."""
    model, _ = routed_model()
    model.router.calibration.copy_(torch.linspace(0, 0.02, 101, dtype=torch.float64))
    decide = chunk_decisions(model, RouterSchedule(budget=0.2), batch_size=1, device="cpu")
    assert decide.threshold == 0.5
    wants = torch.tensor([[-0.1] * 20 + [1.0] * 10])  # p = 0.48 on 20 chunks, then 0.73 on 10
    modes = decide(wants)[0]
    assert modes[:20].sum() == 0  # saved: the burst reads 6 in a row (0.2 x 26 + 1), then one per 5 chunks
    assert modes[20:].tolist() == [1] * 6 + [0] * 3 + [1]
    explicit = chunk_decisions(model, RouterSchedule(budget=0.2, threshold=0.4), batch_size=1, device="cpu")
    assert explicit.threshold == 0.4 and explicit(wants)[0][:20].sum() == 5  # asked otherwise: spent first-come


@pytest.mark.parametrize("schedule,router_layers", [("router threshold=0.5", 1), ("router budget=0.3", 1),
                                                   ("router threshold=0.4 chunk_size=4", 1),
                                                   ("router threshold=0.5", 2), ("router threshold=0.4 chunk_size=3", 2)])
def test_generation_decides_each_chunk_as_one_routing_pass_over_the_whole_sequence(schedule, router_layers):
    """Prefill decides the prompt's chunks from one routing pass; each later chunk is decided at its first
    token, from the first layer's reads of it before that token's step (``route_step``; a router of two
    layers reads the all-linear pass that generation keeps beside the model's). The logits equal one
    parallel forward over prompt + output with the modes route_modes gives it. Under a budget the router
    wants more chunks than the quota allows: generation reads attention on at most budget x chunks + 1
    chunk (its tokens: budget x tokens + one chunk's), where its wishes alone would read more."""
    model, args = routed_model(router_layers=router_layers)
    parsed = parse_schedule(schedule)
    if parsed.budget is not None:
        with torch.no_grad():
            model.router.fc2.bias.add_(0.6)  # p from ~0.5 up: it wants 2 of each sequence's 3 and 4 chunks
    prompts = [tokens(args, 1, 13, seed=2)[0].tolist(), tokens(args, 1, 21, seed=3)[0].tolist()]  # ragged
    result = generate(model, prompts, schedule, 12, output_logits=True)
    attention_tokens, over_quota = 0, False
    for prompt, new, logits in zip(prompts, result.tokens, result.logits):
        ids = torch.tensor([prompt + new[:-1]])  # 24 and 32 tokens: whole chunks
        with torch.no_grad():
            modes = route_modes(model, parsed, ids)
            want = model(ids, modes)[0, len(prompt) - 1:]
        assert (logits - want).abs().max() < 1e-9
        attention_tokens += int((modes == Mode.ATTENTION).sum())
        if parsed.budget is not None:  # the quota after each chunk, and the reads the router wants without it
            allowed = parsed.budget * torch.arange(1, ids.shape[1] // CHUNK + 1) + 1
            assert ((modes[0, ::CHUNK] == Mode.ATTENTION).cumsum(0) <= allowed).all(), modes[0, ::CHUNK]
            threshold = chunk_decisions(model, parsed, 1, "cpu").threshold
            wishes = route_modes(model, RouterSchedule(threshold=threshold), ids)
            over_quota |= bool(((wishes[0, ::CHUNK] == Mode.ATTENTION).cumsum(0) > allowed).any())
    assert result.stats.tokens_per_mode["attention"] == attention_tokens > 0  # what generation read: some attention
    assert over_quota == (parsed.budget is not None)  # a path ignoring the quota would fail the bound above


def test_bad_router_specs_give_one_named_line():
    with pytest.raises(ValueError, match=r"give threshold=P, budget=FRACTION or both"):
        parse_schedule("router")
    with pytest.raises(ValueError, match=r"budget=1.5 is not in \[0, 1\]"):
        parse_schedule("router budget=1.5")
    with pytest.raises(ValueError, match=r"cannot read 'thresh=0.5'"):
        parse_schedule("router thresh=0.5")
    with pytest.raises(ValueError, match=r"threshold='high' is not a number"):
        parse_schedule("router threshold=high")
    plain, args = tiny_args("oryx_tg"), None
    model = build_model(plain, transformer_config(plain, params_dtype=torch.float32))
    with pytest.raises(ValueError, match=r"needs a model with a router \(router.hidden\)"):
        generate(model, [[1, 2, 3]], "router threshold=0.5", 2)
    with pytest.raises(ValueError, match=r"router_hidden=8: a router .* mixers='gdn'"):
        transformer_config(tiny_args("gdn", router_hidden=8))


def test_a_budget_of_an_uncalibrated_router_reads_where_p_reaches_one_half_under_the_quota():
    """A joint router has no calibration (its price held it to its budget in training): `router budget=B`
    reads it at p >= 0.5 under the quota, as `router threshold=0.5 budget=B` does."""
    model, args = routed_model()
    ids = tokens(args, b=4, s=64, seed=3)
    model.router.calibration.fill_(torch.nan)
    modes = route_modes(model, parse_schedule("router budget=0.25"), ids)
    assert torch.equal(modes, route_modes(model, parse_schedule("router threshold=0.5 budget=0.25"), ids))
    wanted = route_modes(model, parse_schedule("router threshold=0.5"), ids)  # about half the chunks
    used, want = ((m == Mode.ATTENTION).view(4, -1, CHUNK)[..., 0].sum(1) for m in (modes, wanted))
    assert bool((used <= 0.25 * 8 + 1).all()) and bool((want > used).any())  # the quota binds: 8 chunks, 0.25
    assert bool(((modes == Mode.ATTENTION) <= (wanted == Mode.ATTENTION)).all())


def test_the_router_is_in_the_checkpoint_and_counted(tmp_path):
    from megatron.core import dist_checkpointing

    from oryx_megatron.models.params import count_parameters

    model, _ = routed_model()
    (tmp_path / "ckpt").mkdir()
    dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"))
    other, _ = routed_model(seed=5)
    other.load_state_dict(dist_checkpointing.load(other.sharded_state_dict(), str(tmp_path / "ckpt")))
    loaded = other.state_dict()
    for name, p in model.state_dict().items():
        if torch.is_tensor(p):
            assert torch.allclose(p, loaded[name], rtol=0, atol=0, equal_nan=True), name
    counts = count_parameters(model)
    assert counts["router"] == sum(p.numel() for p in model.router.parameters()) > 0


def test_speculative_decoding_routes_the_prompt():
    from oryx_megatron.inference import speculative_generate

    model, args = routed_model()
    prompt = tokens(args, 1, 24, seed=4)[0].tolist()
    result = speculative_generate(model, [prompt], "router threshold=0.5", 6, 2, output_logits=True)
    ids = torch.tensor([prompt + result.tokens[0][:-1]])
    with torch.no_grad():
        modes = route_modes(model, parse_schedule("router threshold=0.5"), ids[:, :24])
        modes = torch.cat([modes, torch.full((1, ids.shape[1] - 24), Mode.ATTENTION, dtype=torch.int8)], 1)
        want = model(ids, modes)[0, 23:]
    assert (result.logits[0] - want).abs().max() < 1e-9
