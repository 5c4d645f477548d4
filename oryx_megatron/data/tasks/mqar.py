"""Multi-query associative recall (Zoology's MQAR), with its queries last or scattered.

A sequence of seq_len + 1 tokens (the last one is only a label). Today's layout (``query_spans`` None):

    k_1 v_1 k_2 v_2 ... k_P v_P | filler ... | k_a1 v_a1 ... k_aQ v_aQ

Keys are distinct ids of the lower half of ``id_range``, values ids of the upper half
(repeats allowed); the Q queries ask distinct keys in random order, each followed by its
value. The filler is random ids of ``id_range`` (noise) or ``filler_id`` repeated; since the
context comes first, the first occurrence of a query key is always its pair.

The scattered layout (``query_spans`` S, ``context_segments`` C), where position does not tell where the
questions are: the P pairs in C context segments, the Q queries in S query spans (sizes as even as
possible), the segments in a random order in which every span asks only keys of earlier context segments
(each asked once), and the filler split at random into the C + S + 1 gaps around them:

    filler | k_1 v_1 k_2 v_2 | filler | k_2 v_2 | filler | k_3 v_3 k_4 v_4 | filler | k_4 v_4 k_1 v_1 | filler

Its noise filler holds value ids only, so a key's first occurrence is still its pair (``solve_mqar``).
``mixed_mode_schedule`` gives each sample's oracle: attention on every query span (first to last key).
"""

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import LinearThenAttention, ModeSchedule, SampleModes
from oryx_megatron.data.tasks import check_int, key_value_ranges, next_token_sample


@dataclasses.dataclass(frozen=True)
class MQARConfig:
    vocab_size: int
    seq_len: int  # tokens in inputs
    num_pairs: int
    num_queries: Optional[int] = None  # num_pairs when unset
    seed: int = 0
    id_range: Optional[Tuple[int, int]] = None  # [low, high) for keys | values; [0, vocab_size) when unset
    filler_id: Optional[int] = None  # None: random noise ids from id_range (scattered: of its values)
    query_spans: Optional[int] = None  # None: the queries last; S: the scattered layout's query spans
    context_segments: Optional[int] = None  # scattered: segments of the pairs (None: query_spans)

    def __post_init__(self):
        check_int(self.vocab_size, 2, "MQARConfig.vocab_size")
        check_int(self.seq_len, 1, "MQARConfig.seq_len")
        check_int(self.num_pairs, 1, "MQARConfig.num_pairs")
        check_int(self.seed, 0, "MQARConfig.seed")
        if self.num_queries is None:
            object.__setattr__(self, "num_queries", self.num_pairs)
        check_int(self.num_queries, 1, "MQARConfig.num_queries")
        if self.num_queries > self.num_pairs:
            raise ValueError(
                f"MQARConfig.num_queries={self.num_queries} exceeds num_pairs={self.num_pairs} (each query asks another key)"
            )
        (key_low, key_high), _ = self.key_value_ranges
        if self.num_pairs > key_high - key_low:
            raise ValueError(
                f"MQARConfig.num_pairs={self.num_pairs} exceeds the {key_high - key_low} distinct keys of "
                f"id_range={self.id_range!r} (vocab_size={self.vocab_size}); keys are the lower half of the range"
            )
        needed = 2 * (self.num_pairs + self.num_queries) - 1
        if self.seq_len < needed:
            raise ValueError(
                f"MQARConfig.seq_len={self.seq_len} is too short for num_pairs={self.num_pairs} and "
                f"num_queries={self.num_queries}: pairs and queries need {needed} tokens"
            )
        if self.filler_id is not None:
            check_int(self.filler_id, 0, "MQARConfig.filler_id")
            if self.filler_id >= self.vocab_size:
                raise ValueError(f"MQARConfig.filler_id={self.filler_id} must be < vocab_size={self.vocab_size}")
            if key_low <= self.filler_id < key_high:
                raise ValueError(f"MQARConfig.filler_id={self.filler_id} is a key id (keys are [{key_low}, {key_high})): "
                                 "a query could find the filler instead of its pair")
        if self.query_spans is not None:
            self._check_scattered()

    def _check_scattered(self) -> None:
        check_int(self.query_spans, 1, "MQARConfig.query_spans")
        if self.context_segments is None:
            object.__setattr__(self, "context_segments", self.query_spans)
        check_int(self.context_segments, 1, "MQARConfig.context_segments")
        for name, parts, items in (("query_spans", self.query_spans, "num_queries"),
                                   ("context_segments", self.context_segments, "num_pairs")):
            if parts > getattr(self, items):
                raise ValueError(f"MQARConfig.{name}={parts} exceeds {items}={getattr(self, items)} (no segment is empty)")

    @property
    def key_value_ranges(self) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """([low, high) of the keys, [low, high) of the values): the halves of id_range."""
        return key_value_ranges(self.id_range, 0, self.vocab_size, "MQARConfig.id_range")

    @property
    def query_start(self) -> int:
        """Position in inputs of the first query key."""
        return self.seq_len + 1 - 2 * self.num_queries


def generate_mqar(cfg: MQARConfig, n_samples: int) -> Dict[str, np.ndarray]:
    """The sample dict of ``data.tasks`` (A = Q = num_queries; answer_mask at the query keys), plus
    ``query_span_mask`` [n, seq_len]: True on every query span of inputs, from its first key to its last."""
    check_int(n_samples, 1, "n_samples")
    if cfg.query_spans is not None:
        return _generate_scattered(cfg, n_samples)
    rng = np.random.default_rng(cfg.seed)
    (key_low, key_high), (value_low, value_high) = cfg.key_value_ranges
    n, pairs, queries, start = n_samples, cfg.num_pairs, cfg.num_queries, cfg.query_start
    keys = key_low + np.stack([rng.choice(key_high - key_low, pairs, replace=False) for _ in range(n)])  # [n, P]
    values = rng.integers(value_low, value_high, (n, pairs))  # [n, P]
    asked = np.stack([rng.permutation(pairs)[:queries] for _ in range(n)])  # [n, Q]

    if cfg.filler_id is None:
        seq = rng.integers(key_low, value_high, (n, cfg.seq_len + 1))
    else:
        seq = np.full((n, cfg.seq_len + 1), cfg.filler_id, np.int64)
    seq[:, 0 : 2 * pairs : 2], seq[:, 1 : 2 * pairs : 2] = keys, values
    seq[:, start::2] = np.take_along_axis(keys, asked, 1)
    seq[:, start + 1 :: 2] = np.take_along_axis(values, asked, 1)
    answer_at = np.zeros(seq.shape, bool)
    answer_at[:, start + 1 :: 2] = True
    query_positions = np.broadcast_to(start + 2 * np.arange(queries), (n, queries)).copy()  # [n, Q]
    span = np.zeros((n, cfg.seq_len), bool)
    span[:, start : cfg.seq_len] = True  # the last answer is a label only
    return next_token_sample(seq, answer_at, query_positions, query_span_mask=span)


def _generate_scattered(cfg: MQARConfig, n_samples: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(cfg.seed)
    (key_low, key_high), (value_low, value_high) = cfg.key_value_ranges
    length, pairs, queries = cfg.seq_len + 1, cfg.num_pairs, cfg.num_queries
    filler = length - 2 * (pairs + queries)
    seq = np.empty((n_samples, length), np.int64)
    answer_at, span = np.zeros((n_samples, length), bool), np.zeros((n_samples, cfg.seq_len), bool)
    query_positions = np.empty((n_samples, queries), np.int64)
    for i in range(n_samples):
        keys = key_low + rng.choice(key_high - key_low, pairs, replace=False)
        values = rng.integers(value_low, value_high, pairs)
        segments = _segment_order(rng, cfg)  # [(is a query span, pair indices)]
        gaps = np.diff(np.concatenate([[0], np.sort(rng.integers(0, filler + 1, len(segments))), [filler]]))
        if cfg.filler_id is None:
            row = rng.integers(value_low, value_high, filler)
        else:
            row = np.full(filler, cfg.filler_id, np.int64)
        pieces, asked, done = [], [], 0
        for (is_query, which), gap in zip(segments, gaps):
            pieces.append(row[done : done + gap])
            done += gap
            start = sum(map(len, pieces))
            if is_query:
                asked += [start + 2 * j for j in range(len(which))]
                span[i, start : start + 2 * len(which) - 1] = True
            pieces.append(np.stack([keys[which], values[which]], 1).ravel())
        pieces.append(row[done:])
        seq[i] = np.concatenate(pieces)
        query_positions[i] = asked
        answer_at[i, np.array(asked) + 1] = True
    return next_token_sample(seq, answer_at, query_positions, query_span_mask=span)


def _segment_order(rng: np.random.Generator, cfg: MQARConfig):
    """The segments of one scattered sample in order, each (is a query span, its pair indices): drawn one
    after the other among the segments left (a context segment with the odds of its count), a query span
    only once enough of the keys shown are not asked yet; it asks them in random order."""
    contexts = [list(part) for part in np.array_split(rng.permutation(cfg.num_pairs), cfg.context_segments)]
    spans = [len(part) for part in np.array_split(np.arange(cfg.num_queries), cfg.query_spans)]
    order, unasked = [], []
    while contexts or spans:
        span_ready = bool(spans) and len(unasked) >= spans[0]
        if contexts and (not span_ready or rng.random() < len(contexts) / (len(contexts) + len(spans))):
            part = contexts.pop()
            unasked += part
            order.append((False, np.array(part)))
            continue
        picked = set(rng.choice(len(unasked), spans.pop(0), replace=False).tolist())
        order.append((True, rng.permutation([k for j, k in enumerate(unasked) if j in picked])))
        unasked = [k for j, k in enumerate(unasked) if j not in picked]
    return order


def solve_mqar(sample: Dict[str, np.ndarray]) -> np.ndarray:
    """Reference solver: the token after the first earlier occurrence of each query key, [n, Q]."""
    inputs, query_positions = sample["inputs"], sample["query_positions"]
    answers = np.empty(query_positions.shape, np.int64)
    for i, (row, queries) in enumerate(zip(inputs, query_positions)):
        hits = (row[None, :] == row[queries][:, None]) & (np.arange(row.size) < queries[:, None])  # [Q, L]
        if not hits.any(axis=1).all():
            raise ValueError(f"MQAR sample {i}: a query key occurs nowhere before its query")
        answers[i] = row[hits.argmax(axis=1) + 1]
    return answers


def mixed_mode_schedule(cfg: MQARConfig, sample: Dict[str, np.ndarray]) -> ModeSchedule:
    """The oracle of ``sample``: linear on the context and filler, attention on the query spans of inputs.
    Queries last: the paper's mixed mode, the last 2 Q - 1 tokens (the last answer is a label only);
    scattered: each sample's spans."""
    if cfg.query_spans is None:
        return LinearThenAttention(n_last=2 * cfg.num_queries - 1)
    modes = np.where(sample["query_span_mask"], Mode.ATTENTION, Mode.LINEAR)
    return SampleModes(modes, "query_spans (attention on each sample's query spans)")
