"""Synthetic retrieval tasks: Zoology-style MQAR (``mqar``) and needle in a haystack (``niah``).

Data, not evaluation: ``data.synthetic`` trains on MQAR samples, ``eval.retrieval`` scores
both tasks. Each generator is a pure numpy function of its config (seed included) and the
number of samples. It builds sequences of seq_len + 1 tokens and returns them laid out like a
training batch (dict of int64 / bool arrays):

    inputs           [n, seq_len]  the tokens fed to the model
    labels           [n, seq_len]  the next token of every position (inputs shifted by one)
    answer_mask      [n, seq_len]  True where the label is an answer token (loss, accuracy)
    answers          [n, A]        the answer tokens in order (= labels[answer_mask] per row)
    query_positions  [n, Q]        where each question starts in inputs

plus task-specific fields. Each task has a reference solver that reads every answer off the
context, and ``mixed_mode_schedule(cfg)``: the paper's mixed mode (linear on the context,
attention on the question/answer span) as a data-layer ModeSchedule over inputs.
"""

from typing import Dict, Optional, Tuple

import numpy as np

from oryx_megatron.data.modes import check_int

__all__ = ["check_int", "key_value_ranges", "next_token_sample"]


def key_value_ranges(id_range: Optional[Tuple[int, int]], default_low: int, vocab_size: int,
                     where: str) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """([low, high) of the keys, [low, high) of the values): the lower and upper halves of
    ``id_range``, which is [default_low, vocab_size) when unset."""
    low, high = (default_low, vocab_size) if id_range is None else id_range
    if not 0 <= low < high <= vocab_size or high - low < 2:
        raise ValueError(
            f"{where}={id_range!r} must be (low, high) with 0 <= low, low + 2 <= high <= vocab_size={vocab_size}"
        )
    mid = int(low) + (int(high) - int(low)) // 2
    return (int(low), mid), (mid, mid + (int(high) - int(low)) // 2)


def next_token_sample(seq: np.ndarray, answer_at: np.ndarray, query_positions: np.ndarray, **extra) -> Dict[str, np.ndarray]:
    """seq [n, L + 1] int, answer_at [n, L + 1] bool (the answer tokens) -> the sample dict above."""
    n = seq.shape[0]
    return dict(
        inputs=seq[:, :-1],
        labels=seq[:, 1:],
        answer_mask=answer_at[:, 1:],
        answers=seq[answer_at].reshape(n, -1),
        query_positions=query_positions,
        **extra,
    )
