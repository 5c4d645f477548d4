"""Synthetic MQAR (multi-query associative recall) training batches.

Sample ``i`` (global index) is ``generate_mqar`` of one sample with a seed derived from
``(seed, split, i)``: a pure function of those, so every data-parallel layout and every
resume sees the same samples. ``loss_mask`` is 1 on the answer positions only (the MQAR
convention); ``modes`` come from the mode schedule like every loader's. A sample is one
document: with ``reset_at_eod``, its ``document_ids`` are zeros.
"""

import dataclasses
from typing import Dict, Optional

import numpy as np
import torch

from oryx_megatron.data.loader import RankBatches
from oryx_megatron.data.tasks.mqar import MQARConfig, generate_mqar

# Tags that keep the seed streams of the splits apart.
SPLIT_TAGS = {"train": 0, "valid": 1}


class MQARLoader(RankBatches):
    """Endless micro-batches of MQAR samples for data-parallel rank ``dp_rank`` of ``dp_size``."""

    def __init__(self, *, seq_len: int, micro_batch_size: int, vocab_size: int, num_pairs: int,
                 num_queries: Optional[int] = None, filler_id: Optional[int] = None,
                 query_spans: Optional[int] = None, context_segments: Optional[int] = None, seed: int = 1234,
                 dp_rank: int = 0, dp_size: int = 1, mode_schedule=None, split: str = "train",
                 reset_at_eod: bool = False):
        super().__init__(seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size, mode_schedule=mode_schedule, reset_at_eod=reset_at_eod)
        if split not in SPLIT_TAGS:
            raise ValueError(f"split must be one of {tuple(SPLIT_TAGS)}, got {split!r}")
        self.split, self.vocab_size = split, vocab_size
        self.task = MQARConfig(vocab_size, seq_len, num_pairs, num_queries, filler_id=filler_id,  # validates once
                               query_spans=query_spans, context_segments=context_segments)

    def sample(self, index: int) -> Dict[str, np.ndarray]:
        """The MQAR sample (``generate_mqar``'s dict, n = 1) of global index ``index``."""
        seed = int(np.random.SeedSequence([self.seed, SPLIT_TAGS[self.split], index]).generate_state(1)[0])
        return generate_mqar(dataclasses.replace(self.task, seed=seed), 1)

    def __next__(self) -> Dict[str, torch.Tensor]:
        samples = [self.sample(i) for i in self.sample_indices()]
        stack = lambda key, dtype: torch.from_numpy(np.concatenate([s[key] for s in samples]).astype(dtype))
        shape = (self.micro_batch_size, self.seq_len)
        return self._finish({
            "tokens": stack("inputs", np.int64),
            "labels": stack("labels", np.int64),
            "loss_mask": stack("answer_mask", np.float32),
            "position_ids": torch.arange(self.seq_len).expand(shape).contiguous(),
        })

    def _document_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.zeros(tokens.shape, dtype=torch.int32)  # one document per sample, no EOD

    def _identity(self) -> dict:
        return {"seq_len": self.seq_len, "seed": self.seed, "split": self.split, "vocab_size": self.vocab_size,
                "num_pairs": self.task.num_pairs, "num_queries": self.task.num_queries,
                "filler_id": self.task.filler_id, **self._layout()}

    def _layout(self) -> dict:
        """The scattered layout's fields (none for the queries last: the states saved before it stay valid)."""
        t = self.task
        return {} if t.query_spans is None else {"query_spans": t.query_spans, "context_segments": t.context_segments}

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, **self._identity()}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved global sample count (any ``dp_size``: samples are global)."""
        self._check_state(state, **self._identity())
        self.consumed_samples = state["consumed_samples"]
