"""Deterministic, resumable micro-batches for one data-parallel rank, from token shards.

Layout (all pure functions of the seed and the counters in ``state_dict``):

- Shards are visited in an endless sequence of epochs, each in a fresh seeded order;
  rank r of dp takes visits r, r + dp, r + 2 dp, ... so ranks read disjoint shards.
- A visit expands its shard's documents in a seeded order (per epoch and shard), each
  followed by the EOD token; consecutive visits form the rank's token stream of a source.
- A sample is a window of ``seq_len + 1`` tokens starting at ``k * seq_len`` for the
  rank's k-th sample of that source (windows overlap by one token, as in Megatron).
- Sources are blended as in Megatron's ``--data-path w1 p1 w2 p2``: each sample goes to
  the source whose drawn count lags its weight the most.
- Modes come from the schedule, keyed by the global sample index.

Workers only read and shuffle shards ahead of time, so batches do not depend on
``num_workers``.
"""

import collections
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from oryx_megatron.data.modes import ModeSchedule, build_mode_schedule
from oryx_megatron.data.shards import Manifest, ShardInfo, read_documents

# Tags that keep the seeded generators of different purposes apart.
_SHARD_ORDER, _DOCUMENT_ORDER = 1, 2


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


def _read_stream(path: Path, shard: ShardInfo, eod_id: int, dtype: str, seed_words: list) -> np.ndarray:
    """One shard's documents in seeded order, each followed by EOD (runs in a worker)."""
    docs = read_documents(path)
    tokens = sum(len(d) for d in docs)
    if (len(docs), tokens) != (shard.documents, shard.tokens):
        raise ValueError(f"shard {path} holds {len(docs)} documents / {tokens} tokens, its manifest says "
                         f"{shard.documents} / {shard.tokens}: the shard is damaged or from another run")
    stream = np.empty(tokens + len(docs), dtype)
    pos = 0
    for i in np.random.default_rng(seed_words).permutation(len(docs)):
        stream[pos:pos + len(docs[i])] = docs[i]
        pos += len(docs[i]) + 1
        stream[pos - 1] = eod_id
    return stream


class _RankStream:
    """The token stream one rank reads from one source (see the module docstring)."""

    def __init__(self, manifest: Manifest, source: int, seed: int, dp_rank: int, dp_size: int,
                 pool: Optional[ProcessPoolExecutor], lookahead: int):
        self.manifest, self.source, self.seed = manifest, source, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.pool, self.lookahead = pool, lookahead
        self._order_cache = (-1, None)
        self._pending = collections.deque()  # upcoming visits: futures (with a pool) or arguments
        self.seek(0)

    def _visit(self, visit: int) -> Tuple[int, int]:
        """(epoch, shard index) of the rank's visit number ``visit``."""
        epoch, position = divmod(self.dp_rank + visit * self.dp_size, len(self.manifest.shards))
        if self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, self.source, epoch, _SHARD_ORDER])
            self._order_cache = (epoch, rng.permutation(len(self.manifest.shards)))
        return epoch, int(self._order_cache[1][position])

    def seek(self, offset: int) -> None:
        """Position the stream so that the next window may start at ``offset`` (no shard is read)."""
        visit, start = 0, 0
        while start + (length := self._stream_length(self.manifest.shards[self._visit(visit)[1]])) <= offset:
            start, visit = start + length, visit + 1
        self._next_visit, self._buffer_start = visit, start
        self._buffer = np.empty(0, self.manifest.token_dtype)
        while self._pending:
            pending = self._pending.pop()
            if self.pool:
                pending.cancel()

    @staticmethod
    def _stream_length(shard: ShardInfo) -> int:
        return shard.tokens + shard.documents  # an EOD after each document

    def _load_next(self) -> np.ndarray:
        while len(self._pending) < self.lookahead:
            epoch, shard = self._visit(self._next_visit)
            self._next_visit += 1
            info = self.manifest.shards[shard]
            args = (self.manifest.shard_path(info), info, self.manifest.eod_id, self.manifest.token_dtype,
                    [self.seed, self.source, epoch, shard, _DOCUMENT_ORDER])
            self._pending.append(self.pool.submit(_read_stream, *args) if self.pool else args)
        pending = self._pending.popleft()
        return pending.result() if self.pool else _read_stream(*pending)

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream; ``start`` never goes back."""
        while self._buffer_start + len(self._buffer) < start + length:
            self._buffer = np.concatenate([self._buffer, self._load_next()])
        self._buffer = self._buffer[start - self._buffer_start:]
        self._buffer_start = start
        return self._buffer[:length]


class RankBatches:
    """What every loader shares: the global sample layout, the modes and the consumed-samples
    counter. Micro-batch ``k`` of rank ``r`` holds the global samples
    ``k * mbs * dp + r * mbs + [0, mbs)`` (Megatron's pretraining sampler order)."""

    def __init__(self, *, seq_len: int, micro_batch_size: int, seed: int, dp_rank: int, dp_size: int,
                 mode_schedule):
        for name, value, low in (("seq_len", seq_len, 1), ("micro_batch_size", micro_batch_size, 1),
                                 ("dp_size", dp_size, 1), ("dp_rank", dp_rank, 0)):
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if dp_rank >= dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not below dp_size {dp_size}")
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.mode_schedule: ModeSchedule = build_mode_schedule(mode_schedule)
        self.consumed_samples = 0  # global, over all ranks

    def sample_indices(self) -> range:
        """Global indices of the samples of the next micro-batch of this rank."""
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        return range(first, first + self.micro_batch_size)

    def _finish(self, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        batch["modes"] = self.mode_schedule.batch(self.seq_len, self.sample_indices(), self.seed)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch

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
    for data-parallel rank ``dp_rank`` of ``dp_size``; an endless iterator.

    ``data_path``: a manifest (file or directory), or Megatron's ``--data-path`` list
    ``[w1, p1, w2, p2, ...]``; without weights sources are drawn in proportion to their tokens.
    ``num_workers`` processes read and shuffle upcoming shards; the batches do not depend on it.
    ``mode_schedule``: a ModeSchedule or its config (default ``random_chunks``).
    ``holdout_shards``/``split``: read only the "train" or the held-out "valid" shards of
    each source (``Manifest.split``); 0 reads all shards.
    """

    def __init__(self, data_path, *, seq_len: int, micro_batch_size: int, seed: int = 1234, dp_rank: int = 0,
                 dp_size: int = 1, num_workers: int = 0, mode_schedule=None, holdout_shards: int = 0,
                 split: str = "train"):
        super().__init__(seq_len=seq_len, micro_batch_size=micro_batch_size, seed=seed, dp_rank=dp_rank,
                         dp_size=dp_size, mode_schedule=mode_schedule)
        paths, weights = parse_blend(data_path)
        self.manifests = [Manifest.read(p) for p in paths]
        if holdout_shards or split == "valid":
            self.manifests = [m.split(holdout_shards, split) for m in self.manifests]
        first = self.manifests[0]
        for path, m in zip(paths[1:], self.manifests[1:]):
            if (m.tokenizer["sha256"], m.eod_id, m.vocab_size) != (first.tokenizer["sha256"], first.eod_id, first.vocab_size):
                raise ValueError(f"{path} was tokenized with another tokenizer than {paths[0]}; blended sources must share one")
        for path, m in zip(paths, self.manifests):
            if m.tokens == 0:
                raise ValueError(f"{path} holds no tokens")
        self.vocab_size, self.eod_id = first.vocab_size, first.eod_id
        sizes = np.array([m.tokens for m in self.manifests], np.float64)
        self.weights = np.array(weights) if weights else sizes / sizes.sum()
        self._pool = ProcessPoolExecutor(num_workers) if num_workers > 0 else None
        self._streams = [_RankStream(m, i, seed, dp_rank, dp_size, self._pool, max(1, num_workers))
                         for i, m in enumerate(self.manifests)]
        self._source_samples = np.zeros(len(self._streams), np.int64)  # samples this rank drew per source

    def _next_window(self) -> np.ndarray:
        drawn = int(self._source_samples.sum())
        source = int(np.argmax(self.weights * max(drawn, 1) - self._source_samples))  # Megatron's blending rule
        start = int(self._source_samples[source]) * self.seq_len
        self._source_samples[source] += 1
        return self._streams[source].window(start, self.seq_len + 1)

    def __next__(self) -> Dict[str, torch.Tensor]:
        windows = torch.from_numpy(np.stack([self._next_window() for _ in range(self.micro_batch_size)]).astype(np.int64))
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
            "source_samples": self._source_samples.tolist(),
            "dp_size": self.dp_size,
            "seq_len": self.seq_len,
            "seed": self.seed,
            "sources": [[m.documents, m.tokens] for m in self.manifests],
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume. Same ``dp_size``: exactly where the saved loader stopped. Another ``dp_size``:
        the global sample count (hence modes) continues exactly and each source's stream resumes
        at the same overall depth, rescaled per rank (see docs/data.md)."""
        self._check_state(state, seq_len=self.seq_len, seed=self.seed,
                          sources=[[m.documents, m.tokens] for m in self.manifests])
        drawn = np.array(state["source_samples"], np.int64)
        if state["dp_size"] != self.dp_size:
            drawn = drawn * state["dp_size"] // self.dp_size
        self.consumed_samples = state["consumed_samples"]
        self._source_samples = drawn
        for stream, n in zip(self._streams, drawn):
            stream.seek(int(n) * self.seq_len)

    def close(self) -> None:
        """Shut the shard-reading worker pool down."""
        if self._pool:
            self._pool.shutdown(cancel_futures=True)
