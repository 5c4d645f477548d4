"""Megatron ``.bin/.idx`` indexed datasets, through ``megatron.core.datasets`` (GPTDataset,
blended by BlendedMegatronDatasetBuilder), with ``modes`` added to every batch.

Sample selection, packing, shuffling and blending are Megatron's own; this module only
configures them, lays the samples out over data-parallel ranks like Megatron's
pretraining sampler, and adds the modes (and, with ``reset_at_eod``, the document ids of
the tokens: GPTDataset's own ``reset_*`` stay off, so its samples are unchanged).
"""

from collections import OrderedDict
from typing import Dict, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from torch.utils.data import DataLoader

from oryx_megatron.data.loader import RankBatches, parse_blend

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")


class _EodTokenizer:
    """What GPTDataset needs of a tokenizer: the EOD id (and an identity for its cache key)."""

    vocab_size = None

    def __init__(self, eod_id: int):
        self.eod = eod_id
        self.unique_identifiers = OrderedDict(cls="eod_only", eod=eod_id)


SPLITS = ("train", "valid", "test")


def build_gpt_dataset(data_path, *, seq_len: int, num_samples: int, eod_id: int, seed: int = 1234,
                      cache_dir: Optional[str] = None, split: str = "train", split_ratio: str = "100,0,0"):
    """Megatron's dataset of ``num_samples`` samples of one split ("train", "valid", "test";
    documents divided by ``split_ratio``, Megatron's ``--split``) for ``--data-path``-style
    paths (``.bin/.idx`` prefixes, optionally weighted). Index caches go to ``cache_dir``
    (Megatron's default when None: next to the data)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    paths, weights = parse_blend(data_path)
    if cache_dir and len(paths) > 1 and not torch.distributed.is_initialized():
        raise ValueError("cache_dir with several data paths needs torch.distributed initialized "
                         "(Megatron builds the blend cache on rank 0); pass cache_dir=None")
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_len,
        blend=(paths, weights),
        split=split_ratio,
        path_to_cache=cache_dir,
        tokenizer=_EodTokenizer(eod_id),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    sizes = [num_samples if name == split else 0 for name in SPLITS]
    dataset = BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()[SPLITS.index(split)]
    if dataset is None:
        raise ValueError(f"split_ratio={split_ratio!r} gives the {split!r} split no documents")
    return dataset


class IndexedLoader(RankBatches):
    """Micro-batches for data-parallel rank ``dp_rank`` of ``dp_size`` from Megatron indexed
    datasets; stops after ``num_samples`` global samples. Resuming at any parallel layout
    continues exactly at the saved global sample count (Megatron's ``consumed_samples``)."""

    def __init__(self, data_path, *, seq_len: int, micro_batch_size: int, num_samples: int, eod_id: int,
                 seed: int = 1234, dp_rank: int = 0, dp_size: int = 1, num_workers: int = 0, mode_schedule=None,
                 cache_dir: Optional[str] = None, split: str = "train", split_ratio: str = "100,0,0",
                 reset_at_eod: bool = False):
        super().__init__(seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size, mode_schedule=mode_schedule, reset_at_eod=reset_at_eod)
        self.num_samples, self.num_workers, self.eod_id = num_samples, num_workers, eod_id
        self.dataset = build_gpt_dataset(data_path, seq_len=seq_len, num_samples=num_samples, eod_id=eod_id,
                                         seed=seed, cache_dir=cache_dir, split=split, split_ratio=split_ratio)
        self._batches = None

    def _index_batches(self):
        global_batch = self.micro_batch_size * self.dp_size
        for first in range(self.consumed_samples, self.num_samples - global_batch + 1, global_batch):
            start = first + self.dp_rank * self.micro_batch_size
            yield list(range(start, start + self.micro_batch_size))

    def __next__(self) -> Dict[str, torch.Tensor]:
        if self._batches is None:
            loader = DataLoader(self.dataset, batch_sampler=self._index_batches(), num_workers=self.num_workers)
            self._batches = iter(loader)
        batch = next(self._batches)
        return self._finish({key: batch[key] for key in BATCH_KEYS})

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seq_len": self.seq_len, "seed": self.seed,
                "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        self._check_state(state, seq_len=self.seq_len, seed=self.seed, num_samples=self.num_samples)
        self.consumed_samples = state["consumed_samples"]
        self.close()

    def close(self) -> None:
        """Drop the torch DataLoader iterator, which shuts its worker processes down."""
        self._batches = None
