"""Self-speculative decoding (linear drafts, attention verifies): greedy output equals attention-mode
greedy decoding token for token; the accept/reject rule samples exactly the target distribution."""

import numpy as np
import pytest
import torch

from oryx_megatron.inference import Sampler, SamplingParams, accept_drafts, generate, speculative_generate
from oryx_megatron.models.builder import build_model, transformer_config
from tests.helpers import tiny_args

pytestmark = pytest.mark.usefixtures("single_process_parallel", "one_thread")

VOCAB = 97


# Random weights: at the default init std linear and attention mode agree on every greedy token
# (every draft accepted); larger weights make them disagree sometimes, or always.
MODELS = {"tg_all_accepted": ("oryx_tg", 0.02), "tg_mixed": ("oryx_tg", 0.1), "tm_all_rejected": ("oryx_tm", 0.15)}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, single_process_parallel):
    family, std = MODELS[request.param]
    args = tiny_args(family, init_method_std=std)
    torch.manual_seed(0)
    return build_model(args, transformer_config(args, params_dtype=torch.float64))


def prompt(n=7, seed=0):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("schedule", ["prefill=linear decode=attention", "all_attention"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_attention_decoding(model, schedule, k):
    target = generate(model, [prompt()], schedule, 12, vocab_size=VOCAB, output_logits=True)
    result = speculative_generate(model, [prompt()], schedule, 12, k, vocab_size=VOCAB, output_logits=True)
    assert result.tokens == target.tokens and result.finish_reasons == ["length"]
    assert (result.logits[0] - target.logits[0]).abs().max() < 1e-9
    stats = result.stats
    assert 0 < stats.drafted and 0 <= stats.accepted <= stats.drafted
    assert 0 <= stats.acceptance_rate <= 1 and stats.decode_tokens == 11 and stats.decode_tokens_per_s > 0


@pytest.mark.parametrize("name,accepted", [("tg_all_accepted", 1.0), ("tg_mixed", "partial"), ("tm_all_rejected", 0.0)])
def test_the_models_cover_acceptance_partial_acceptance_and_rejection(name, accepted, single_process_parallel):
    family, std = MODELS[name]
    args = tiny_args(family, init_method_std=std)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, params_dtype=torch.float64))
    rate = speculative_generate(model, [prompt()], "all_attention", 12, 3, vocab_size=VOCAB).stats.acceptance_rate
    assert 0 < rate < 1 if accepted == "partial" else rate == accepted


def test_speculative_stops_at_a_stop_token(model):
    full = generate(model, [prompt(seed=1)], "all_attention", 10, vocab_size=VOCAB).tokens[0]
    stop = full[4]
    result = speculative_generate(model, [prompt(seed=1)], "all_attention", 10, 4, stop_token_ids=[stop],
                                  vocab_size=VOCAB)
    assert result.tokens[0] == full[: full.index(stop) + 1] and result.finish_reasons == ["stop"]


def test_speculative_refuses_bad_arguments(model):
    with pytest.raises(ValueError, match="speculative decoding supports batch 1 \\(one prompt\\), got 2 prompts"):
        speculative_generate(model, [prompt(), prompt()], "all_attention", 4, 2)
    with pytest.raises(ValueError, match="speculative_tokens must be an integer >= 1, got 0"):
        speculative_generate(model, [prompt()], "all_attention", 4, 0)
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        speculative_generate(model, [prompt()], "all_attention", 4, 2, cuda_graphs=True)


def total_variation(counts: np.ndarray, probs: np.ndarray) -> float:
    return 0.5 * np.abs(counts / counts.sum() - probs).sum()


def test_accept_reject_rule_samples_the_target_distribution():
    """A 'model' whose target p_t and draft q_t depend only on the position t: speculative rounds
    with k = 2 produce the first 3 tokens distributed as p_0 x p_1 x p_2 (20000 draws,
    total variation < 0.02 per position and < 0.03 jointly for the first two), while the drafts
    alone follow q (far from p)."""
    p = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.1, 0.3, 0.5], [0.2, 0.2, 0.2, 0.2, 0.2],
                      [0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.1, 0.2, 0.1, 0.3]])  # [positions, V]
    q = torch.tensor([[0.1, 0.1, 0.2, 0.3, 0.3], [0.4, 0.3, 0.1, 0.1, 0.1], [0.7, 0.1, 0.1, 0.05, 0.05],
                      [0.2, 0.2, 0.2, 0.2, 0.2]])
    sampler, k, draws = Sampler(SamplingParams(temperature=1.0, seed=0)), 2, 20000
    outputs, drafts_only = np.zeros((draws, 3), np.int64), np.zeros(draws, np.int64)
    for n in range(draws):
        out = []
        while len(out) < 3:
            t = len(out)
            drafts = sampler.draw(q[t : t + k])  # [k]
            accepted, token = accept_drafts(p[t : t + k + 1], q[t : t + k], drafts, sampler)
            if t == 0:
                drafts_only[n] = drafts[0]
            out += drafts[:accepted].tolist() + [token]
        outputs[n] = out[:3]
    for t in range(3):
        assert total_variation(np.bincount(outputs[:, t], minlength=5), p[t].numpy()) < 0.02
    joint = np.bincount(outputs[:, 0] * 5 + outputs[:, 1], minlength=25)
    assert total_variation(joint, torch.outer(p[0], p[1]).flatten().numpy()) < 0.03
    assert total_variation(np.bincount(drafts_only, minlength=5), p[0].numpy()) > 0.3  # the draft is far off


def test_greedy_rule_accepts_while_the_argmax_agrees():
    sampler = Sampler(SamplingParams())
    one_hot = torch.eye(4)
    p, q = one_hot[[2, 1, 3, 0]], one_hot[[2, 1, 0]]  # the target agrees on 2 drafts, then wants 3
    assert accept_drafts(p, q, torch.tensor([2, 1, 0]), sampler) == (2, 3)
    assert accept_drafts(p, one_hot[[2, 1, 3]], torch.tensor([2, 1, 3]), sampler) == (3, 0)  # all accepted: bonus


def test_speculative_sampling_matches_the_target_end_to_end(single_process_parallel):
    """800 seeded runs of a 1-layer model (temperature 1, top-k 3): the second token (the first
    one speculated, k = 1) follows the exact attention-mode marginal sum_t1 p(t1) p(t2 | t1)
    within total variation 0.08; linear-mode drafting alone would be 0.5 away."""
    args = tiny_args("oryx_tg", init_method_std=0.1, num_layers=1, hidden_size=32, num_attention_heads=2,
                     ffn_hidden_size=64)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, params_dtype=torch.float64)).eval()
    ids, runs = torch.tensor([prompt(5)]), 800
    counts = np.zeros(model.vocab_size)
    for seed in range(runs):
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        result = speculative_generate(model, ids.tolist(), "prefill=linear decode=attention", 3, 2, sampling=params,
                                      vocab_size=VOCAB)
        counts[result.tokens[0][1]] += 1

    sampler, prompt_modes = Sampler(SamplingParams(temperature=1.0, top_k=3), VOCAB), torch.zeros(1, 5, dtype=torch.int8)
    candidates = torch.arange(model.vocab_size)[:, None]  # every first token t1
    with torch.no_grad():
        p1 = sampler.probs(model(ids, prompt_modes)[:, -1])[0].double()  # [V]
        continued = torch.cat([ids.expand(len(candidates), -1), candidates], dim=1)
        second_modes = {mode: torch.cat([prompt_modes.expand(len(candidates), -1),
                                         torch.full_like(candidates, mode, dtype=torch.int8)], dim=1) for mode in (0, 1)}
        marginal = {mode: (p1[:, None] * sampler.probs(model(continued, m)[:, -1]).double()).sum(0).numpy()
                    for mode, m in second_modes.items()}
    assert total_variation(counts, marginal[1]) < 0.08
    assert 0.5 * np.abs(marginal[0] - marginal[1]).sum() > 0.3  # the linear draft is far from the target
