"""Synthetic retrieval tasks: answers recoverable by construction, seeded, mixed-mode schedules."""

import dataclasses

import numpy as np
import pytest

from oryx_megatron.data.tasks.mqar import MQARConfig, generate_mqar, solve_mqar
from oryx_megatron.data.tasks.mqar import mixed_mode_schedule as mqar_modes
from oryx_megatron.data.tasks.niah import NIAHConfig, generate_niah, solve_niah
from oryx_megatron.data.tasks.niah import mixed_mode_schedule as niah_modes

CORPUS = np.arange(1, 4000) % 199 + 1  # a stand-in for held-out corpus tokens (no 0: the marker)


def check_layout(sample, n, seq_len):
    """inputs/labels/answer_mask/answers agree with each other."""
    inputs, labels, mask = sample["inputs"], sample["labels"], sample["answer_mask"]
    assert inputs.shape == labels.shape == mask.shape == (n, seq_len)
    assert np.array_equal(inputs[:, 1:], labels[:, :-1])
    assert np.array_equal(labels[mask].reshape(n, -1), sample["answers"])


def assert_samples_equal(a, b):
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("filler_id", [None, 63])
def test_mqar_answers_are_recoverable(filler_id):
    for seed in range(20):
        cfg = MQARConfig(vocab_size=64, seq_len=48, num_pairs=8, num_queries=5, seed=seed, filler_id=filler_id)
        sample = generate_mqar(cfg, 4)
        check_layout(sample, 4, 48)
        assert np.array_equal(solve_mqar(sample), sample["answers"])
        (key_low, key_high), (value_low, value_high) = cfg.key_value_ranges
        keys = sample["inputs"][:, 0 : 2 * cfg.num_pairs : 2]
        assert ((keys >= key_low) & (keys < key_high)).all() and all(len(set(row)) == cfg.num_pairs for row in keys)
        assert ((sample["answers"] >= value_low) & (sample["answers"] < value_high)).all()
        assert np.array_equal(sample["answer_mask"].nonzero()[1].reshape(4, -1), sample["query_positions"])


def test_mqar_seeds_reproduce_and_differ():
    cfg = MQARConfig(vocab_size=256, seq_len=64, num_pairs=8, seed=1)
    assert_samples_equal(generate_mqar(cfg, 3), generate_mqar(cfg, 3))
    other = generate_mqar(dataclasses.replace(cfg, seed=2), 3)
    assert not np.array_equal(generate_mqar(cfg, 3)["inputs"], other["inputs"])
    assert cfg.num_queries == 8  # defaults to num_pairs


def test_mqar_mixed_mode_is_attention_on_the_query_span_only():
    cfg = MQARConfig(vocab_size=256, seq_len=200, num_pairs=16, num_queries=4)
    sample = generate_mqar(cfg, 3)
    modes = mqar_modes(cfg, sample).batch(cfg.seq_len, range(3)).numpy()  # [n, seq_len]
    positions = np.arange(cfg.seq_len)
    assert np.array_equal(modes == 1, np.broadcast_to(positions >= sample["query_positions"][:, :1], modes.shape))
    assert np.array_equal(modes == 1, sample["query_span_mask"])
    assert modes.mean() == pytest.approx((cfg.seq_len - cfg.query_start) / cfg.seq_len) == 7 / 200


def scattered(**fields):
    return MQARConfig(**{"vocab_size": 64, "seq_len": 96, "num_pairs": 8, "num_queries": 6, "query_spans": 3,
                         "context_segments": 4, **fields})


def span_runs(mask):
    """[(start, end)] of the runs of True in a bool row."""
    edges = np.diff(np.concatenate([[0], mask.astype(int), [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


@pytest.mark.parametrize("filler_id", [None, 40])
def test_scattered_mqar_answers_are_recoverable_and_asked_after_their_pair(filler_id):
    for seed in range(20):
        cfg = scattered(seed=seed, filler_id=filler_id)
        sample = generate_mqar(cfg, 8)
        check_layout(sample, 8, 96)
        assert np.array_equal(solve_mqar(sample), sample["answers"])
        (key_low, key_high), _ = cfg.key_value_ranges
        for row, queries, mask in zip(sample["inputs"], sample["query_positions"], sample["query_span_mask"]):
            is_key = (row >= key_low) & (row < key_high)
            assert is_key.sum() == cfg.num_pairs + cfg.num_queries  # no filler token is a key
            assert len(set(row[queries])) == cfg.num_queries  # each key asked once ...
            first = [np.flatnonzero(row == key)[0] for key in row[queries]]
            assert all(pair < query for pair, query in zip(first, queries))  # ... after its pair
            runs = span_runs(mask)  # every span from its first query key to its last, the spans apart
            assert len(runs) == cfg.query_spans  # spans of 2 queries: k v k, both keys at its ends
            assert np.array_equal(np.concatenate([[start, end - 1] for start, end in runs]), queries)
        assert np.array_equal(sample["answer_mask"].nonzero()[1].reshape(8, -1), sample["query_positions"])


def test_scattered_query_spans_are_not_at_a_known_place():
    cfg = scattered(seed=3)
    sample = generate_mqar(cfg, 500)
    first, last = sample["query_positions"][:, 0], sample["query_positions"][:, -1]
    assert first.min() < 20 and first.max() > 60  # the first question anywhere after the first context segment
    assert (last >= cfg.seq_len - 8).mean() < 0.5  # the last 8 tokens hold the last question in under half
    span_share = sample["query_span_mask"].mean(0)  # per position: the samples whose spans cover it
    assert span_share[12:].min() > 0.02 and span_share.max() < 0.2  # no position is a span's in most samples


def test_scattered_oracle_reads_attention_on_each_samples_query_spans_only():
    cfg = scattered(seed=5)
    sample = generate_mqar(cfg, 6)
    oracle = mqar_modes(cfg, sample)
    modes = oracle.batch(cfg.seq_len, range(6)).numpy()
    assert np.array_equal(modes == 1, sample["query_span_mask"])
    assert modes.mean() == pytest.approx(3 * 3 / 96)  # 3 spans of 2 queries: k v k each
    assert str(oracle).startswith("query_spans")


def test_scattered_mqar_seeds_reproduce_and_differ():
    cfg = scattered(seed=1)
    assert_samples_equal(generate_mqar(cfg, 3), generate_mqar(cfg, 3))
    other = generate_mqar(dataclasses.replace(cfg, seed=2), 3)
    assert not np.array_equal(generate_mqar(cfg, 3)["query_positions"], other["query_positions"])
    assert scattered(context_segments=None).context_segments == 3  # defaults to query_spans


@pytest.mark.parametrize("num_needles", [1, 4])
@pytest.mark.parametrize("haystack", [None, CORPUS])
def test_niah_answers_are_recoverable(num_needles, haystack):
    for seed in range(20):
        cfg = NIAHConfig(vocab_size=256, seq_len=96, num_needles=num_needles, key_len=2, value_len=3, seed=seed)
        sample = generate_niah(haystack, cfg, 3)
        check_layout(sample, 3, 96)
        assert np.array_equal(solve_niah(sample), sample["answers"])
        inputs, p = sample["inputs"], sample["prompt_len"]
        assert np.array_equal(np.concatenate([inputs[:, p:], sample["labels"][:, -1:]], 1), sample["answers"])
        for i, row in enumerate(inputs):
            needles, asked, q = sample["needle_positions"][i], sample["target"][i], sample["query_positions"][i, 0]
            assert set(np.flatnonzero(row == cfg.marker_id)) == set(needles) | {q}  # the only markers
            keys = [tuple(row[j + 1 : j + 3]) for j in needles]
            assert len(set(keys)) == num_needles and keys[asked] == tuple(row[q + 1 : p])


def test_niah_depths_place_the_needles():
    cfg = NIAHConfig(vocab_size=64, seq_len=60, num_needles=2, depths=(1.0, 0.0))
    sample = generate_niah(None, cfg, 2)
    assert sample["needle_positions"].tolist() == [[cfg.haystack_len + 7, 0]] * 2  # needles of 7 tokens
    assert sample["query_positions"].tolist() == [[cfg.haystack_len + 14]] * 2


def test_niah_seeds_reproduce_and_differ():
    cfg = NIAHConfig(vocab_size=256, seq_len=96, num_needles=3, seed=5)
    assert_samples_equal(generate_niah(CORPUS, cfg, 3), generate_niah(CORPUS, cfg, 3))
    other = generate_niah(CORPUS, dataclasses.replace(cfg, seed=6), 3)
    assert not np.array_equal(generate_niah(CORPUS, cfg, 3)["inputs"], other["inputs"])


def test_niah_mixed_mode_is_attention_on_question_and_answer():
    cfg = NIAHConfig(vocab_size=256, seq_len=120, key_len=3, value_len=5)
    sample = generate_niah(None, cfg, 2)
    modes = niah_modes(cfg).batch(cfg.seq_len, range(2)).numpy()
    q = sample["query_positions"][0, 0]
    assert modes[:, :q].max() == 0 and modes[:, q:].min() == 1
    assert modes.mean() == pytest.approx((cfg.seq_len - q) / cfg.seq_len) == 8 / 120


def mqar(**fields):
    return MQARConfig(**{"vocab_size": 64, "seq_len": 64, "num_pairs": 4, **fields})


def niah(**fields):
    return NIAHConfig(**{"vocab_size": 64, "seq_len": 64, **fields})


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: mqar(seq_len=100, num_pairs=40), r"MQARConfig.num_pairs=40 exceeds the 32 distinct keys"),
        (lambda: mqar(seq_len=20, num_pairs=8), r"MQARConfig.seq_len=20 is too short .* need 31 tokens"),
        (lambda: mqar(num_queries=5), r"MQARConfig.num_queries=5 exceeds num_pairs=4"),
        (lambda: mqar(num_pairs=0), r"MQARConfig.num_pairs must be an integer >= 1"),
        (lambda: mqar(id_range=(10, 80)), r"MQARConfig.id_range=\(10, 80\)"),
        (lambda: mqar(filler_id=64), r"MQARConfig.filler_id=64"),
        (lambda: mqar(filler_id=3), r"MQARConfig.filler_id=3 is a key id \(keys are \[0, 32\)\)"),
        (lambda: generate_mqar(mqar(), 0), r"n_samples must be an integer >= 1"),
        (lambda: mqar(num_queries=2, query_spans=3), r"MQARConfig.query_spans=3 exceeds num_queries=2"),
        (lambda: mqar(query_spans=2, context_segments=5), r"MQARConfig.context_segments=5 exceeds num_pairs=4"),
        (lambda: mqar(query_spans=0), r"MQARConfig.query_spans must be an integer >= 1"),
        (lambda: niah(seq_len=20, num_needles=3), r"NIAHConfig.seq_len=20 is too short: num_needles=3 .* need 27"),
        (lambda: niah(vocab_size=9, seq_len=200, num_needles=5), r"NIAHConfig.num_needles=5 exceeds the 4 distinct"),
        (lambda: niah(marker_id=5), r"NIAHConfig.marker_id=5 must be .* outside"),
        (lambda: niah(num_needles=2, depths=(0.5,)), r"NIAHConfig.depths=\(0.5,\)"),
        (lambda: niah(key_len=0), r"NIAHConfig.key_len must be an integer >= 1"),
        (lambda: generate_niah(np.arange(1, 10), niah(), 1), r"haystack_tokens holds 9 tokens, fewer than the 51"),
        (lambda: generate_niah(np.arange(0, 100), niah(vocab_size=128), 1), r"haystack_tokens contains marker_id=0"),
        (lambda: generate_niah(np.arange(1, 100), niah(), 1), r"haystack_tokens holds ids outside \[0, vocab_size=64\)"),
    ],
)
def test_bad_parameters_raise_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()
