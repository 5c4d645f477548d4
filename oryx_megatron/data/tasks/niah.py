"""Needle in a haystack, single and multi-key (as RULER's niah_single / niah_multikey).

A sequence of seq_len + 1 tokens (the last one is only a label):

    haystack ... m k_1 v_1 ... haystack ... m k_2 v_2 ... haystack | m k_t | v_t
                                                                    question  answer

A needle is the marker id m, a key of key_len ids (lower half of id_range) and a value of
value_len ids (upper half), inserted at a depth in [0, 1] of the haystack (seeded uniform
draws, or ``depths``). With num_needles > 1 the keys are distinct and one needle, drawn at
random, is asked; the others are distractors. The haystack is a window at a seeded offset
of the given token stream (e.g. held-out corpus tokens) or random ids of id_range; it must
not contain the marker, so the needles are the only marker occurrences before the question.
For generation the prompt is inputs[:, :prompt_len] and the answer the value_len tokens after.
"""

import dataclasses
from typing import Dict, Optional, Tuple

import numpy as np

from oryx_megatron.data.modes import LinearThenAttention
from oryx_megatron.data.tasks import check_int, key_value_ranges, next_token_sample


@dataclasses.dataclass(frozen=True)
class NIAHConfig:
    vocab_size: int
    seq_len: int  # tokens in inputs
    num_needles: int = 1  # > 1: multi-key
    key_len: int = 2
    value_len: int = 4
    marker_id: int = 0
    id_range: Optional[Tuple[int, int]] = None  # [low, high) for keys | values; [1, vocab_size) when unset
    depths: Optional[Tuple[float, ...]] = None  # one per needle, in [0, 1]; None: uniform draws
    seed: int = 0

    def __post_init__(self):
        for name, minimum in (("vocab_size", 3), ("seq_len", 1), ("num_needles", 1), ("key_len", 1),
                              ("value_len", 1), ("marker_id", 0), ("seed", 0)):
            check_int(getattr(self, name), minimum, f"NIAHConfig.{name}")
        (key_low, key_high), (_, value_high) = self.key_value_ranges
        if self.marker_id >= self.vocab_size or key_low <= self.marker_id < value_high:
            raise ValueError(
                f"NIAHConfig.marker_id={self.marker_id} must be < vocab_size={self.vocab_size} and outside "
                f"the key/value ids [{key_low}, {value_high}) (id_range={self.id_range!r})"
            )
        if self.num_needles > key_high - key_low:
            raise ValueError(
                f"NIAHConfig.num_needles={self.num_needles} exceeds the {key_high - key_low} distinct first key ids "
                f"of id_range={self.id_range!r} (vocab_size={self.vocab_size})"
            )
        if self.depths is not None:
            depths = tuple(self.depths)
            if len(depths) != self.num_needles or not all(0 <= d <= 1 for d in depths):
                raise ValueError(
                    f"NIAHConfig.depths={self.depths!r} must hold num_needles={self.num_needles} values in [0, 1]"
                )
            object.__setattr__(self, "depths", depths)
        if self.haystack_len < 0:
            needed = self.seq_len - self.haystack_len
            raise ValueError(
                f"NIAHConfig.seq_len={self.seq_len} is too short: num_needles={self.num_needles} needles of "
                f"1 + key_len + value_len = {1 + self.key_len + self.value_len} tokens, the question and "
                f"the answer need {needed}"
            )

    @property
    def key_value_ranges(self) -> Tuple[Tuple[int, int], Tuple[int, int]]:
        """([low, high) of the key ids, [low, high) of the value ids): the halves of id_range."""
        return key_value_ranges(self.id_range, 1, self.vocab_size, "NIAHConfig.id_range")

    @property
    def prompt_len(self) -> int:
        """Tokens up to the end of the question: inputs[:, :prompt_len] is the generation prompt."""
        return self.seq_len + 1 - self.value_len

    @property
    def haystack_len(self) -> int:
        needles = self.num_needles * (1 + self.key_len + self.value_len)
        return self.prompt_len - needles - 1 - self.key_len


def generate_niah(haystack_tokens: Optional[np.ndarray], cfg: NIAHConfig, n_samples: int) -> Dict[str, np.ndarray]:
    """The sample dict of ``data.tasks`` (A = value_len, Q = 1: the question's marker), plus
    needle_positions [n, num_needles] (marker positions), target [n] (the needle asked) and
    prompt_len (int)."""
    check_int(n_samples, 1, "n_samples")
    stream = _check_haystack(haystack_tokens, cfg)
    rng = np.random.default_rng(cfg.seed)
    (key_low, key_high), (value_low, value_high) = cfg.key_value_ranges
    n, needles, hay_len = n_samples, cfg.num_needles, cfg.haystack_len
    seq = np.empty((n, cfg.seq_len + 1), np.int64)
    needle_positions = np.empty((n, needles), np.int64)
    target = rng.integers(0, needles, n)  # [n]
    for i in range(n):
        if stream is None:
            hay = rng.integers(key_low, value_high, hay_len)
        else:
            offset = rng.integers(0, stream.size - hay_len + 1)
            hay = stream[offset : offset + hay_len]
        keys = np.concatenate([  # [N, key_len], distinct first ids
            key_low + rng.choice(key_high - key_low, (needles, 1), replace=False),
            rng.integers(key_low, key_high, (needles, cfg.key_len - 1)),
        ], axis=1)
        values = rng.integers(value_low, value_high, (needles, cfg.value_len))  # [N, value_len]
        depths = np.asarray(cfg.depths if cfg.depths is not None else rng.random(needles))
        cuts = np.round(depths * hay_len).astype(np.int64)  # haystack offset of each needle
        pieces, done = [], 0
        for j in np.argsort(cuts, kind="stable"):
            pieces.append(hay[done : cuts[j]])
            needle_positions[i, j] = sum(map(len, pieces))
            pieces.append(np.concatenate([[cfg.marker_id], keys[j], values[j]]))
            done = cuts[j]
        pieces.append(hay[done:])
        pieces.append(np.concatenate([[cfg.marker_id], keys[target[i]], values[target[i]]]))
        seq[i] = np.concatenate(pieces)
    answer_at = np.zeros(seq.shape, bool)
    answer_at[:, cfg.prompt_len :] = True
    query_positions = np.full((n, 1), cfg.prompt_len - 1 - cfg.key_len, np.int64)
    return next_token_sample(
        seq, answer_at, query_positions, needle_positions=needle_positions, target=target, prompt_len=cfg.prompt_len
    )


def _check_haystack(tokens: Optional[np.ndarray], cfg: NIAHConfig) -> Optional[np.ndarray]:
    if tokens is None:
        return None
    stream = np.asarray(tokens)
    if stream.ndim != 1 or not np.issubdtype(stream.dtype, np.integer):
        raise ValueError(f"haystack_tokens must be a 1-D integer array, got shape {stream.shape} dtype {stream.dtype}")
    if stream.size < cfg.haystack_len:
        raise ValueError(
            f"haystack_tokens holds {stream.size} tokens, fewer than the {cfg.haystack_len} of one haystack "
            f"(seq_len={cfg.seq_len})"
        )
    if stream.size and (stream.min() < 0 or stream.max() >= cfg.vocab_size):
        raise ValueError(f"haystack_tokens holds ids outside [0, vocab_size={cfg.vocab_size})")
    if (stream == cfg.marker_id).any():
        raise ValueError(f"haystack_tokens contains marker_id={cfg.marker_id}; choose a marker the haystack never uses")
    return stream


def solve_niah(sample: Dict[str, np.ndarray]) -> np.ndarray:
    """Reference solver: the value of the needle whose marker and key match the question, [n, value_len]."""
    inputs, prompt_len = sample["inputs"], sample["prompt_len"]
    value_len = inputs.shape[1] + 1 - prompt_len
    answers = np.empty((inputs.shape[0], value_len), np.int64)
    for i, (row, (q,)) in enumerate(zip(inputs, sample["query_positions"])):
        question = row[q:prompt_len]  # marker, key
        windows = np.lib.stride_tricks.sliding_window_view(row[:q], question.size)
        match = np.flatnonzero((windows == question).all(axis=1))
        if match.size == 0:
            raise ValueError(f"NIAH sample {i}: no needle before the question matches its marker and key")
        start = match[0] + question.size
        answers[i] = row[start : start + value_len]
    return answers


def mixed_mode_schedule(cfg: NIAHConfig) -> LinearThenAttention:
    """Linear on the haystack and needles, attention on the question and answer in inputs
    (key_len + value_len tokens: the marker, the key, all answer tokens but the last)."""
    return LinearThenAttention(n_last=cfg.key_len + cfg.value_len)
