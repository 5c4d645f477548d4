"""Generation with the inference cache equals recomputing the parallel forward at every step;
sampling, schedules, stop tokens and stats."""

import numpy as np
import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import all_attention, linear_then_attention, switch_at
from oryx_megatron.inference import (
    ALL_ATTENTION,
    ALL_LINEAR,
    LINEAR_PREFILL,
    PhaseSchedule,
    PositionSchedule,
    Sampler,
    SamplingParams,
    Span,
    SpanSchedule,
    as_inference_schedule,
    generate,
    parse_schedule,
)
from oryx_megatron.inference.sampling import top_k_mask, top_p_mask
from oryx_megatron.mixer import KV_BLOCK
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models import transformer_step
from tests.helpers import tiny_args

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")

VOCAB = 97  # tiny_args' tokenizer vocab; the model's is padded to 128
PROMPT_LENGTHS = (5, 9, 12)
MAX_NEW = 6


@pytest.fixture(scope="module", params=["oryx_tg", "oryx_tm"])
def model(request, single_process_parallel):
    args = tiny_args(request.param)
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64))


def prompts(lengths=PROMPT_LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def recompute_greedy(model, prompt, schedule, max_new):
    """Reference: a full parallel forward over prompt + generated tokens at every step."""
    modes = torch.from_numpy(schedule.position_modes(len(prompt), len(prompt) + max_new - 1))
    tokens, logits = list(prompt), []
    greedy = Sampler(SamplingParams(), VOCAB)
    with torch.no_grad():
        for _ in range(max_new):
            last = model(torch.tensor([tokens]), modes[None, : len(tokens)])[:, -1]  # [1, V]
            logits.append(last[0])
            tokens.append(greedy(last).item())
    return tokens[len(prompt):], torch.stack(logits)


@pytest.mark.parametrize(
    "schedule",
    [
        "all_attention",
        "all_linear",
        "prefill=linear decode=attention",
        "linear_then_attention n_last=8",  # a training schedule: the switch falls at another position per prompt
        "attention:0-7,linear:7-",  # mid-prompt for prompts 9 and 12, mid-generation for 5
        "linear:0-11,attention:11-",  # mid-generation for prompt 9, mid-prompt for 12
    ],
)
def test_cached_generation_equals_parallel_recompute(model, schedule):
    assert_cached_generation_equals_recompute(model, schedule)


def assert_cached_generation_equals_recompute(model, schedule):
    """Greedy tokens and logits of ``generate`` (fp64) equal ``recompute_greedy``'s for every prompt."""
    batch = prompts()
    result = generate(model, batch, schedule, MAX_NEW, vocab_size=VOCAB, output_logits=True)
    for i, prompt in enumerate(batch):
        tokens, logits = recompute_greedy(model, prompt, parse_schedule(schedule), MAX_NEW)
        assert result.tokens[i] == tokens
        assert (result.logits[i] - logits).abs().max() < 1e-9
    assert result.finish_reasons == ["length"] * len(batch)


def test_last_token_logits_are_the_last_row(model):
    """A prefill asks for the last position's logits only: the same numbers, no [b, s, V] tensor."""
    ids = torch.tensor(prompts([11, 11]))
    modes = torch.randint(0, 2, ids.shape, generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    with torch.no_grad():
        full = model(ids, modes)
        last = model(ids, modes, last_token_logits=True)
    assert last.shape == (2, 1, full.shape[-1]) and (last - full[:, -1:]).abs().max() < 1e-12


def test_stop_tokens_max_tokens_and_stats(model):
    batch, schedule = prompts(seed=1), as_inference_schedule(switch_at(10))  # a data-layer ModeSchedule
    full = generate(model, batch, schedule, MAX_NEW, vocab_size=VOCAB)
    stop = full.tokens[0][2]
    result = generate(model, batch, schedule, MAX_NEW, stop_token_ids=[stop], vocab_size=VOCAB)
    expected_fed = np.zeros(len(Mode), np.int64)
    for i, prompt in enumerate(batch):
        out = full.tokens[i]
        if stop in out:
            assert result.tokens[i] == out[: out.index(stop) + 1] and result.finish_reasons[i] == "stop"
        else:
            assert result.tokens[i] == out and result.finish_reasons[i] == "length"
        assert len(result.tokens[i]) <= MAX_NEW
        fed = len(prompt) + len(result.tokens[i]) - 1  # the last generated token is never fed
        expected_fed += np.bincount(schedule.position_modes(len(prompt), fed), minlength=len(Mode))
    assert result.finish_reasons[0] == "stop"

    stats = result.stats
    assert stats.tokens_per_mode == {"linear": expected_fed[0], "attention": expected_fed[1]}
    assert stats.prefill_tokens == len(batch) * min(PROMPT_LENGTHS)
    assert stats.prefill_tokens + stats.decode_tokens == expected_fed.sum()
    assert stats.attention_fraction == pytest.approx(expected_fed[1] / expected_fed.sum())
    assert stats.prefill_tokens_per_s > 0 and stats.decode_tokens_per_s > 0
    # Static caches: KV buffers for the longest prompt + MAX_NEW, allocated in blocks of KV_BLOCK.
    layers, b, heads, d, fp64 = 2, len(batch), 4, 16, 8
    positions = -(-(max(PROMPT_LENGTHS) + MAX_NEW) // KV_BLOCK) * KV_BLOCK
    assert full.stats.cache_bytes["kv"] == layers * 2 * b * positions * heads * d * fp64
    assert full.stats.cache_bytes["recurrent"] == layers * b * heads * d * d * fp64


# ---- the Transformer baseline: megatron's own KV cache ----

@pytest.fixture(scope="module")
def transformer(single_process_parallel):
    args = tiny_args("transformer")
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64))


def test_transformer_cached_generation_equals_parallel_recompute(transformer):
    """Ragged prompts (a prefill of the shortest, then teacher-forced and generated steps) through megatron's
    static inference context give the greedy tokens and logits of a full forward at every step."""
    batch = prompts((5, 9, 12))
    result = generate(transformer, batch, "all_attention", MAX_NEW, vocab_size=VOCAB, output_logits=True)
    for i, prompt in enumerate(batch):
        tokens, logits = recompute_greedy(transformer, prompt, ALL_ATTENTION, MAX_NEW)
        assert result.tokens[i] == tokens
        assert (result.logits[i] - logits).abs().max() < 1e-12
    assert result.stats.tokens_per_mode["linear"] == 0
    layers, b, heads, d, fp64 = 2, len(batch), 4, 16, 8
    assert result.stats.cache_bytes == {"kv": layers * 2 * KV_BLOCK * b * heads * d * fp64, "recurrent": 0, "conv": 0}


def test_transformer_cache_grows_by_a_block_when_full(transformer):
    """A prefill, a 3-token call on the filled cache across its capacity (an offset causal mask), then steps."""
    ids = torch.tensor(prompts((KV_BLOCK + 4,), seed=5))
    transformer.eval()
    with torch.no_grad():
        want = transformer(ids)
        cache = transformer.allocate_inference_cache(1, torch.float64)  # KV_BLOCK positions
        got = [transformer(ids[:, : KV_BLOCK - 2], inference_cache=cache)]
        got += [transformer(ids[:, KV_BLOCK - 2 : KV_BLOCK + 1], inference_cache=cache)]
        got += [transformer(ids[:, t : t + 1], inference_cache=cache) for t in range(KV_BLOCK + 1, KV_BLOCK + 4)]
    assert cache[0].capacity == 2 * KV_BLOCK and cache[0].seqlen == KV_BLOCK + 4
    assert (torch.cat(got, dim=1) - want).abs().max() < 1e-12


def test_transformer_says_what_it_cannot_decode(transformer):
    from oryx_megatron.inference import speculative_generate

    batch = prompts()
    with pytest.raises(ValueError, match=r"^the Transformer baseline reads attention only: schedule 'prefill=linear "
                                         r"decode=attention' makes position 0 of prompt 0 read linear; use an "
                                         r"attention-only schedule such as all_attention$"):
        generate(transformer, batch, LINEAR_PREFILL, MAX_NEW, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^the Transformer baseline reads attention only: schedule 'all_linear'"):
        generate(transformer, batch, ALL_LINEAR, MAX_NEW, vocab_size=VOCAB, kv_cache=False)
    with pytest.raises(ValueError, match=r"^the Transformer baseline reads attention only and needs its KV cache"):
        transformer.allocate_inference_cache(1, torch.float64, kv_cache=False)
    with pytest.raises(ValueError, match=r"^speculative decoding drafts in linear mode: the Transformer baseline"):
        speculative_generate(transformer, batch[:1], ALL_ATTENTION, MAX_NEW, 2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"^cuda_graphs=True: the Transformer baseline decodes eagerly"):
        generate(transformer, batch, ALL_ATTENTION, MAX_NEW, vocab_size=VOCAB, cuda_graphs=True)
    transformer.train()
    with pytest.raises(ValueError, match=r"^the Transformer baseline decodes with its cache in eval mode"):
        transformer(torch.tensor(batch[:1]), inference_cache=transformer.allocate_inference_cache(1, torch.float64))


def test_transformer_documents_need_the_local_core_attention(transformer, monkeypatch):
    """Transformer Engine's core attention (here: any other than the local spec's) gets no explicit mask."""
    transformer.eval()
    monkeypatch.setattr(transformer.decoder.layers[0].self_attention, "core_attention", torch.nn.Identity())
    monkeypatch.setattr(transformer, "direct_step", transformer_step.supports(transformer))  # False, as built so
    ids = torch.tensor(prompts((6,)))
    with pytest.raises(ValueError, match=r"^the Transformer baseline reads packed documents \(reset_at_eod\) .* "
                                         r"with model.transformer_impl=local only"):
        transformer(ids, inference_cache=transformer.allocate_inference_cache(1, torch.float64),
                    document_ids=torch.zeros_like(ids))


def test_sampled_generation_is_reproducible_and_stays_in_vocab(model):
    batch = prompts(seed=2)
    params = SamplingParams(temperature=2.0, top_k=50, top_p=0.95, seed=7)
    first = generate(model, batch, LINEAR_PREFILL, MAX_NEW, sampling=params, vocab_size=VOCAB)
    again = generate(model, batch, LINEAR_PREFILL, MAX_NEW, sampling=params, vocab_size=VOCAB)
    other_params = SamplingParams(temperature=2.0, seed=8)
    other = generate(model, batch, LINEAR_PREFILL, MAX_NEW, sampling=other_params, vocab_size=VOCAB)
    assert first.tokens == again.tokens != other.tokens
    assert max(max(t) for t in first.tokens + other.tokens) < VOCAB


def test_no_kv_cache_equals_linear_generation_with_the_cache(model):
    batch = prompts(seed=3)
    cached = generate(model, batch, ALL_LINEAR, MAX_NEW, vocab_size=VOCAB, output_logits=True)
    no_kv = generate(model, batch, ALL_LINEAR, MAX_NEW, vocab_size=VOCAB, output_logits=True, kv_cache=False)
    assert no_kv.tokens == cached.tokens
    assert all((a - c).abs().max() < 1e-12 for a, c in zip(no_kv.logits, cached.logits))
    assert no_kv.stats.cache_bytes["kv"] == 0 < cached.stats.cache_bytes["kv"]
    assert no_kv.stats.cache_bytes["recurrent"] == cached.stats.cache_bytes["recurrent"]


def test_no_kv_cache_refuses_an_attention_schedule_before_any_compute(model, monkeypatch):
    def forward(*args, **kwargs):
        raise AssertionError("the model ran")

    monkeypatch.setattr(model, "forward", forward)
    with pytest.raises(ValueError, match=r"no KV cache .*schedule 'prefill=linear decode=attention' makes position 5 "
                                         r"of prompt 0 read attention; use a linear-only schedule"):
        generate(model, prompts(), LINEAR_PREFILL, MAX_NEW, vocab_size=VOCAB, kv_cache=False)


def test_calls_pass_a_mode_when_all_their_tokens_read_one(model, monkeypatch):
    """Prefill and steps of one mode get that Mode (the model then runs only its mixer); a mixed
    call gets the modes tensor."""
    calls, forward = [], model.forward

    def spy(ids, modes=None, **kwargs):
        calls.append((ids.shape[1], modes if isinstance(modes, Mode) else "tensor"))
        return forward(ids, modes, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    generate(model, prompts((5, 5)), LINEAR_PREFILL, 3, vocab_size=VOCAB)
    assert calls == [(5, Mode.LINEAR), (1, Mode.ATTENTION), (1, Mode.ATTENTION)]
    calls.clear()
    # step 5 feeds prompt 1's last token (linear) and prompt 0's first generated token (attention)
    generate(model, prompts((5, 6)), LINEAR_PREFILL, 3, vocab_size=VOCAB)
    assert calls == [(5, Mode.LINEAR), (1, "tensor"), (1, Mode.ATTENTION), (1, Mode.ATTENTION)]


def test_generate_rejects_bad_arguments(model):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1, got 0"):
        generate(model, prompts(), "all_attention", 0)
    with pytest.raises(ValueError, match="non-empty token lists"):
        generate(model, [[1], []], "all_attention", 2)
    with pytest.raises(ValueError, match=r"id 100, outside \[0, vocab_size=97\)"):
        generate(model, [[1, 100]], "all_attention", 2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match=r"covers positions \[0, 8\)"):
        generate(model, [[1, 2, 3]], "linear:0-8", 7)


# ---- sampling ----

def test_top_k_and_top_p_masks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 1.0, 0.0, -1.0]])
    assert top_k_mask(logits, 2).tolist() == [[False, True, True, False], [True, True, False, False]]
    assert top_k_mask(logits[1:], 1).tolist() == [[True, True, False, False]]  # ties with the k-th are kept
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    assert top_p_mask(probs, 0.79).tolist() == [[False, True, False, True]]  # 0.5 + 0.3 >= 0.79
    assert top_p_mask(probs, 0.81).tolist() == [[True, True, False, True]]
    assert top_p_mask(probs, 0.2).tolist() == [[False, True, False, False]]  # the top id is always kept
    g = torch.Generator().manual_seed(0)
    draws = torch.cat([Sampler(SamplingParams(temperature=1.0, top_p=0.79, seed=s))(probs) for s in range(200)])
    assert set(draws.tolist()) == {1, 3}
    logits = torch.randn(500, 10, generator=g)
    draws = Sampler(SamplingParams(temperature=5.0, top_k=2))(logits)
    assert top_k_mask(logits, 2).gather(1, draws[:, None]).all()


def test_greedy_seed_and_padded_vocab():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 128, generator=g, dtype=torch.float64)
    assert torch.equal(Sampler(SamplingParams())(logits), logits.argmax(-1))
    params = SamplingParams(temperature=1.5, seed=3)
    assert torch.equal(Sampler(params)(logits), Sampler(params)(logits))
    assert not torch.equal(Sampler(params)(logits), Sampler(SamplingParams(temperature=1.5, seed=4))(logits))
    padded = logits.clone()
    padded[:, VOCAB:] = 50.0  # the padded rows would win every draw
    assert Sampler(SamplingParams(), VOCAB)(padded).max() < VOCAB
    assert Sampler(SamplingParams(temperature=5.0), VOCAB)(padded.repeat(20, 1)).max() < VOCAB


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(temperature=-1.0), "SamplingParams.temperature must be >= 0"),
        (dict(top_k=-2), "SamplingParams.top_k must be an integer >= 0"),
        (dict(top_p=0.0), r"SamplingParams.top_p must be in \(0, 1\]"),
    ],
)
def test_sampling_params_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


# ---- schedules ----

def test_schedules_give_prompt_and_generated_modes():
    assert parse_schedule("all_attention") == ALL_ATTENTION == PositionSchedule(all_attention())
    assert ALL_ATTENTION.position_modes(3, 5).tolist() == [1] * 5
    assert parse_schedule("all_linear") == ALL_LINEAR and ALL_LINEAR.position_modes(3, 5).tolist() == [0] * 5
    tail = parse_schedule("linear_then_attention n_last=2")  # the training schedules, by name and fields
    assert tail == PositionSchedule(linear_then_attention(2)) and tail.position_modes(3, 5).tolist() == [0, 0, 0, 1, 1]
    switch = parse_schedule("switch_at t=1, before=attention after=linear")
    assert switch == as_inference_schedule(switch_at(1, Mode.ATTENTION, Mode.LINEAR))
    assert switch.position_modes(3, 4).tolist() == [1, 0, 0, 0]
    phases = parse_schedule("prefill=linear, decode=attention")
    assert phases == LINEAR_PREFILL == PhaseSchedule("linear", 1)
    assert phases.position_modes(3, 5).tolist() == [0, 0, 0, 1, 1]
    spans = parse_schedule("linear:0-2,attention:2-4,linear:4-")
    assert spans == SpanSchedule((Span(Mode.LINEAR, 0, 2), Span(Mode.ATTENTION, 2, 4), Span(Mode.LINEAR, 4)))
    assert spans.position_modes(9, 6).tolist() == [0, 0, 1, 1, 0, 0]
    assert parse_schedule("attention:0-3").position_modes(1, 2).tolist() == [1, 1]
    for schedule in (phases, spans, tail, switch, ALL_ATTENTION, ALL_LINEAR):
        assert parse_schedule(str(schedule)) == schedule
    assert str(ALL_ATTENTION) == "all_attention" and str(tail) == "linear_then_attention n_last=2"


@pytest.mark.parametrize(
    "text,message",
    [
        ("diagonal", r"unknown schedule 'diagonal'; expected a schedule name \(random_chunks, all_attention, "
                     r"all_linear, switch_at, linear_then_attention, explicit\)"),
        ("all-attention", r"unknown schedule 'all-attention'; expected a schedule name \(random_chunks, all_attention"),
        ("attention", r"unknown schedule 'attention'"),  # a mode, not a schedule
        ("switch_at", r"inference schedule 'switch_at': mode schedule 'switch_at' needs field 't'"),
        ("linear_then_attention n_last=-1", r"linear_then_attention.n_last must be an integer >= 0"),
        ("prefill=lin decode=attention", r"part 'prefill=lin': unknown mode 'lin'"),
        ("prefill=linear", r"missing 'decode=MODE'"),
        ("prefill=linear speed=fast", r"cannot read 'speed=fast'"),
        ("linear:0-100,attn:100-", r"span 'attn:100-': unknown mode 'attn'"),
        ("linear:0-100,attention:90-", r"span 'attention:90-' starts at 90, expected 100"),
        ("linear:0-,attention:5-", r"span 'linear:0-' is open-ended but is not the last"),
        ("linear:0-5,attention:x-", r"cannot read span 'attention:x-'"),
    ],
)
def test_schedule_parse_errors_name_the_bad_part(text, message):
    with pytest.raises(ValueError, match=message):
        parse_schedule(text)


# ---- oryx-generate's decoding flags ----

def test_cli_no_kv_cache_and_speculative(tiny_checkpoint, capsys):
    from oryx_megatron.cli import generate as cli

    common = [tiny_checkpoint, "--prompt", "def ", "--max-new-tokens", "6", "--device", "cpu"]
    assert cli.main(common + ["--schedule", "all_linear", "--no-kv-cache"]) == 0
    kv_row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("cache kv bytes"))
    assert kv_row.split()[-1] == "0"
    assert cli.main(common + ["--schedule", "prefill=linear decode=attention", "--speculative", "3"]) == 0
    assert "speculative drafted / accepted" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(common + ["--schedule", "prefill=linear decode=attention", "--no-kv-cache"])
    error = capsys.readouterr().err
    assert "no KV cache (kv_cache=False / --no-kv-cache): schedule 'prefill=linear decode=attention'" in error
