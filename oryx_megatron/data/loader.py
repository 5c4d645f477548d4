"""Deterministic, resumable micro-batches for one data-parallel rank, from token shards.

Layout (all pure functions of the seed and the global sample index, as Megatron's GPTDataset):

- Each source's documents (those of its split) get a fresh seeded order every epoch; the
  epoch's token stream is the documents in that order, each followed by the EOD token.
- The epoch's samples are the windows ``stream[w * seq_len : w * seq_len + seq_len + 1]``
  (they overlap by one token and span document and shard boundaries); the epoch visits
  them in a seeded order (a permutation of all its windows). Sample ``j`` of a source is
  window ``perm_e[j % n]`` of epoch ``e = j // n``.
- Sources are blended by Megatron's rule (``weight * max(i, 1) - drawn``) over the global
  sample index, in blocks of ``BLEND_BLOCK`` samples; global sample ``i`` is thus the same
  window for every data-parallel layout, and a resumed loader continues exactly.
- Modes come from the schedule, keyed by the global sample index.

Shards are read on demand (by ``num_workers`` processes ahead of time, if any) and a few
are cached per source, so batches do not depend on ``num_workers``.
"""

import collections
import tarfile
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from oryx_megatron.data.documents import document_ids
from oryx_megatron.data.modes import ModeSchedule, build_mode_schedule
from oryx_megatron.data.shards import Manifest, Part, ShardInfo, read_documents, read_npy

# Tags that keep the seeded generators of different purposes apart.
_DOCUMENT_ORDER, _SAMPLE_ORDER = 2, 3
BLEND_BLOCK = 1 << 12  # global samples per period of the blending sequence
SHARD_CACHE = 8  # shards kept in memory per source (plus those read ahead)


def parse_blend(data_path: Union[str, Path, Sequence]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's ``--data-path``: ``[w1, p1, w2, p2, ...]`` or ``[p1, p2, ...]`` (then weights
    are None: proportional to size). Returns (paths, weights normalized to sum 1, or None)."""
    items = [data_path] if isinstance(data_path, (str, Path)) else list(data_path)
    if not items:
        raise ValueError("data_path is empty")
    try:
        float(items[0])
    except (TypeError, ValueError):
        return [str(p) for p in items], None
    if len(items) % 2:
        raise ValueError(f"data_path {items}: weights and paths must alternate (w1 p1 w2 p2 ...)")
    try:
        weights = [float(w) for w in items[::2]]
    except (TypeError, ValueError) as e:
        raise ValueError(f"data_path {items}: weights and paths must alternate ({e})") from None
    if min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"data_path {items}: weights must be >= 0 with a positive sum")
    return [str(p) for p in items[1::2]], [w / sum(weights) for w in weights]


def _read_shard(path: Path, shard: ShardInfo, vocab_size: int, dtype: str) -> Tuple[np.ndarray, np.ndarray]:
    """One shard's tokens (concatenated) and document offsets; checked against the manifest
    (counts) and the vocabulary (ids). Runs in a worker when there are any."""
    docs = read_documents(path)
    tokens = sum(len(d) for d in docs)
    if (len(docs), tokens) != (shard.documents, shard.tokens):
        raise ValueError(f"shard {path} holds {len(docs)} documents / {tokens} tokens, its manifest says "
                         f"{shard.documents} / {shard.tokens}: the shard is damaged (truncated?) or from another run")
    flat = np.concatenate(docs).astype(dtype, copy=False) if docs else np.empty(0, dtype)
    if len(flat) and int(flat.max()) >= vocab_size:
        raise ValueError(f"shard {path} holds token id {int(flat.max())}, beyond the manifest's vocab_size "
                         f"{vocab_size}: the shard is damaged or from another tokenizer")
    offsets = np.zeros(len(docs) + 1, np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    return flat, offsets


def _read_lengths(path: Path, shard: ShardInfo) -> np.ndarray:
    """Tokens per document of one shard, reading only the ``lengths.npy`` members (the tar
    reader seeks past the token arrays)."""
    lengths = []
    try:
        size = path.stat().st_size
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                if member.offset_data + member.size > size:
                    raise ValueError(f"member {member.name!r} ends at byte {member.offset_data + member.size}, "
                                     f"the file has {size}: the shard is truncated")
                if member.name.endswith(".lengths.npy"):
                    lengths.append(read_npy(tar.extractfile(member).read()))
    except (tarfile.TarError, OSError, ValueError) as e:
        raise ValueError(f"cannot read shard {path}: {e}") from None
    lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
    if (len(lengths), int(lengths.sum())) != (shard.documents, shard.tokens):
        raise ValueError(f"shard {path} holds {len(lengths)} documents / {int(lengths.sum())} tokens, its manifest "
                         f"says {shard.documents} / {shard.tokens}: the shard is damaged (truncated?) or from another run")
    return lengths


class _Source:
    """The samples of one source (see the module docstring): document lengths in memory
    (numpy), the current epochs' orders, and a small cache of shards read on demand."""

    def __init__(self, manifest: Manifest, part: Part, index: int, seed: int, seq_len: int,
                 pool: Optional[ProcessPoolExecutor]):
        self.manifest, self.index, self.seed, self.seq_len, self.pool = manifest, index, seed, seq_len, pool
        self.shard_first = np.zeros(len(manifest.shards) + 1, np.int64)  # global id of each shard's first document
        np.cumsum([s.documents for s in manifest.shards], out=self.shard_first[1:])
        self.first_doc, self.start = part.first, part.start  # the split's first document begins at token start
        first_shard = int(np.searchsorted(self.shard_first, part.first, "right")) - 1
        last_shard = int(np.searchsorted(self.shard_first, part.end, "left"))
        lengths = np.concatenate([_read_lengths(manifest.shard_path(manifest.shards[s]), manifest.shards[s])
                                  for s in range(first_shard, last_shard)])
        skip = part.first - int(self.shard_first[first_shard])
        self.lengths = lengths[skip:skip + part.end - part.first].copy()  # the split's (pieces of) documents
        if part.stop is not None:
            self.lengths[-1] = part.stop
        self.lengths[0] -= part.start
        self.documents, self.tokens = len(self.lengths), int(self.lengths.sum())
        self.samples_per_epoch = (self.tokens + self.documents - 1) // seq_len  # an EOD after each document
        if self.samples_per_epoch < 1:
            raise ValueError(f"{manifest.root}: {self.tokens} tokens in {self.documents} documents make no "
                             f"sample of {seq_len + 1} tokens")
        self._epochs: "collections.OrderedDict[int, tuple]" = collections.OrderedDict()
        self._shards: "collections.OrderedDict[int, object]" = collections.OrderedDict()

    def _epoch(self, epoch: int) -> tuple:
        """(document order, end offset of each of them in the stream, sample order) of an epoch."""
        if epoch not in self._epochs:
            docs = np.random.default_rng([self.seed, self.index, epoch, _DOCUMENT_ORDER]).permutation(self.documents)
            ends = np.cumsum(self.lengths[docs] + 1)
            samples = np.random.default_rng([self.seed, self.index, epoch, _SAMPLE_ORDER]).permutation(
                self.samples_per_epoch)
            self._epochs[epoch] = (docs, ends, samples)
            while len(self._epochs) > 2:
                self._epochs.popitem(last=False)
        return self._epochs[epoch]

    def _pieces(self, sample: int):
        """(global document id, first token, end token, EOD after?) pieces of a source sample."""
        epoch, k = divmod(sample, self.samples_per_epoch)
        docs, ends, samples = self._epoch(epoch)
        start = int(samples[k]) * self.seq_len
        end = start + self.seq_len + 1
        i = int(np.searchsorted(ends, start, "right"))
        while start < end:
            doc_start = int(ends[i]) - int(self.lengths[docs[i]]) - 1
            lo, hi = start - doc_start, min(end - doc_start, int(self.lengths[docs[i]]) + 1)
            yield self.first_doc + int(docs[i]), lo, hi
            start, i = doc_start + hi, i + 1

    def shards_of(self, sample: int) -> List[int]:
        return [int(np.searchsorted(self.shard_first, d, "right")) - 1 for d, _, _ in self._pieces(sample)]

    def prefetch(self, shard: int) -> None:
        if self.pool and shard not in self._shards:
            info = self.manifest.shards[shard]
            self._shards[shard] = self.pool.submit(_read_shard, self.manifest.shard_path(info), info,
                                                   self.manifest.vocab_size, self.manifest.token_dtype)

    def _shard(self, shard: int) -> Tuple[np.ndarray, np.ndarray]:
        entry = self._shards.pop(shard, None)
        if isinstance(entry, Future):
            entry = entry.result()
        if entry is None:
            info = self.manifest.shards[shard]
            entry = _read_shard(self.manifest.shard_path(info), info, self.manifest.vocab_size,
                                self.manifest.token_dtype)
        self._shards[shard] = entry  # most recently used last
        loaded = [s for s, e in self._shards.items() if not isinstance(e, Future)]
        for old in loaded[:max(0, len(loaded) - SHARD_CACHE)]:
            del self._shards[old]
        return entry

    def window(self, sample: int) -> np.ndarray:
        out = np.empty(self.seq_len + 1, self.manifest.token_dtype)
        pos = 0
        for doc, lo, hi in self._pieces(sample):
            shard = int(np.searchsorted(self.shard_first, doc, "right")) - 1
            tokens, offsets = self._shard(shard)
            a = int(offsets[doc - int(self.shard_first[shard])]) + (self.start if doc == self.first_doc else 0)
            length = int(self.lengths[doc - self.first_doc])  # of the split's piece of the document
            n = min(hi, length) - lo  # tokens of the document in the window (then maybe its EOD)
            if n > 0:
                out[pos:pos + n] = tokens[a + lo:a + lo + n]
                pos += n
            if hi == length + 1:
                out[pos] = self.manifest.eod_id
                pos += 1
        assert pos == len(out)
        return out


class RankBatches:
    """What every loader shares: the global sample layout, the modes, the document ids and the
    consumed-samples counter. Micro-batch ``k`` of rank ``r`` holds the global samples
    ``k * mbs * dp + r * mbs + [0, mbs)`` (Megatron's pretraining sampler order). With
    ``reset_at_eod``, batches also hold ``document_ids`` (``documents.document_ids`` of the
    tokens and the loader's ``eod_id``)."""

    eod_id: Optional[int] = None

    def __init__(self, *, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int, dp_size: int,
                 mode_schedule, reset_at_eod: bool = False):
        for name, value, low in (("seq_len", seq_len, 1), ("micro_batch_size", micro_batch_size, 1),
                                 ("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not below dp_size {dp_size}")
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.dp_rank, self.dp_size, self.reset_at_eod = dp_rank, dp_size, reset_at_eod
        self.mode_schedule: ModeSchedule = build_mode_schedule(mode_schedule)
        self.consumed_samples = 0  # global, over all ranks

    def sample_indices(self) -> range:
        """Global indices of the samples of the next micro-batch of this rank."""
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        return range(first, first + self.micro_batch_size)

    def _finish(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        batch["modes"] = self.mode_schedule.batch(self.seq_len, self.sample_indices(), self.seed)
        if self.reset_at_eod:
            batch["document_ids"] = self._document_ids(batch["tokens"])
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch

    def _document_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """int32 [mbs, seq_len]: the document of each token within its sample."""
        return document_ids(tokens, self.eod_id)

    def _check_state(self, state: dict, **expected) -> None:
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"loader state has {key}={state.get(key)!r}, this loader has {key}={value!r}")

    def __iter__(self):
        return self

    def close(self) -> None:
        """Release worker processes (none here)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ShardLoader(RankBatches):
    """Micro-batches of packed ``seq_len + 1`` windows from token-shard datasets (manifests),
    for data-parallel rank ``dp_rank`` of ``dp_size``; an endless iterator. Samples are
    shuffled over each whole source (documents and windows, seeded per epoch; see the
    module docstring and docs/data.md); global sample ``i`` does not depend on ``dp_size``.

    ``data_path``: a manifest (file or directory), or Megatron's ``--data-path`` list
    ``[w1, p1, w2, p2, ...]``; without weights sources are drawn in proportion to their tokens.
    ``num_workers`` processes read upcoming shards; the batches do not depend on it.
    ``mode_schedule``: a ModeSchedule or its config (default ``random_chunks``).
    ``holdout_shards``/``split``: read only the "train" or the held-out "valid" documents of
    each source (``Manifest.holdout``: the last ``holdout_shards`` shards, or the last
    ``HOLDOUT_FRACTION`` of the documents of a source with too few shards, or the tail of the
    only document, at least one sample; ``holdout_tail=False``: nothing of a one-document
    source); ``holdout_shards=0`` reads everything. ``reset_at_eod``: add ``document_ids``.
    """

    def __init__(self, data_path, *, seq_len: int, micro_batch_size: int, seed: int = 1234, dp_rank: int = 0,
                 dp_size: int = 1, num_workers: int = 0, mode_schedule=None, holdout_shards: int = 0,
                 split: str = "train", holdout_tail: bool = True, reset_at_eod: bool = False, lookahead: int = 2):
        super().__init__(seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size, mode_schedule=mode_schedule, reset_at_eod=reset_at_eod)
        paths, weights = parse_blend(data_path)
        self.manifests = [Manifest.read(p) for p in paths]
        parts = [m.holdout(holdout_shards, split, min_tokens=seq_len, tail=holdout_tail)
                 if holdout_shards or split == "valid" else Part(0, m.documents) for m in self.manifests]
        first = self.manifests[0]
        for path, m in zip(paths[1:], self.manifests[1:]):
            if (m.tokenizer["sha256"], m.eod_id, m.vocab_size) != (first.tokenizer["sha256"], first.eod_id, first.vocab_size):
                raise ValueError(f"{path} was tokenized with another tokenizer than {paths[0]}; blended sources must share one")
        for path, m, part in zip(paths, self.manifests, parts):
            empty = part.end <= part.first
            if m.tokens == 0 or empty:
                raise ValueError(f"{path} holds no tokens" + (f" in its {split!r} split" if empty else ""))
        self.vocab_size, self.eod_id = first.vocab_size, first.eod_id
        self._pool = ProcessPoolExecutor(num_workers) if num_workers > 0 else None
        self.lookahead = lookahead if self._pool else 0  # micro-batches whose shards are read ahead
        self._sources = [_Source(m, part, i, seed, seq_len, self._pool)
                         for i, (m, part) in enumerate(zip(self.manifests, parts))]
        sizes = np.array([s.tokens for s in self._sources], np.float64)
        self.weights = np.array(weights) if weights else sizes / sizes.sum()
        self._blend_source, self._blend_rank, self._blend_counts = _blending(self.weights, BLEND_BLOCK)

    def _locate(self, index: int) -> Tuple[int, int]:
        """(source, sample of that source) of global sample ``index``."""
        block, pos = divmod(index, BLEND_BLOCK)
        source = int(self._blend_source[pos])
        return source, block * int(self._blend_counts[source]) + int(self._blend_rank[pos])

    def source_samples(self, consumed: int) -> List[int]:
        """Samples drawn from each source by the first ``consumed`` global samples."""
        block, pos = divmod(consumed, BLEND_BLOCK)
        head = np.bincount(self._blend_source[:pos], minlength=len(self._sources))
        return (block * self._blend_counts + head).tolist()

    def _read_ahead(self) -> None:
        global_batch = self.micro_batch_size * self.dp_size
        for k in range(1, self.lookahead + 1):
            for index in self.sample_indices():
                source, sample = self._locate(index + k * global_batch)
                for shard in self._sources[source].shards_of(sample):
                    self._sources[source].prefetch(shard)

    def __next__(self) -> Dict[str, torch.Tensor]:
        self._read_ahead()
        rows = [self._sources[s].window(j) for s, j in map(self._locate, self.sample_indices())]
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        shape = (self.micro_batch_size, self.seq_len)
        return self._finish({
            "tokens": windows[:, :-1].contiguous(),
            "labels": windows[:, 1:].contiguous(),
            "loss_mask": torch.ones(shape, dtype=torch.float32),
            "position_ids": torch.arange(self.seq_len).expand(shape).contiguous(),
        })

    def state_dict(self) -> dict:
        return {
            "consumed_samples": self.consumed_samples,
            "source_samples": self.source_samples(self.consumed_samples),  # for information
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "sources": [[s.documents, s.tokens] for s in self._sources],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume exactly at the saved global sample count, for any ``dp_size`` (global
        sample ``i`` is the same window for every layout)."""
        self._check_state(state, seq_len=self.seq_len, seed=self.seed,
                          sources=[[s.documents, s.tokens] for s in self._sources])
        self.consumed_samples = state["consumed_samples"]

    def close(self) -> None:
        """Shut the shard-reading worker pool down."""
        if self._pool:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def _blending(weights: np.ndarray, block: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's blending rule over ``block`` samples: the source of each sample, its rank
    among that source's samples, and the samples per source (the sequence repeats per block)."""
    n = len(weights)
    source = np.zeros(block, np.int16)
    rank = np.zeros(block, np.int64)
    if n > 1:
        drawn = np.zeros(n, np.int64)
        for i in range(block):
            s = int(np.argmax(weights * max(i, 1) - drawn))
            source[i], rank[i] = s, drawn[s]
            drawn[s] += 1
    else:
        rank[:] = np.arange(block)
    return source, rank, np.bincount(source, minlength=n).astype(np.int64)
