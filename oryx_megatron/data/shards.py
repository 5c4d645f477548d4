"""The on-disk format shared by ``oryx_megatron.data_prep`` (writer) and the loader (reader).

A dataset is a directory with ``manifest.json`` and WebDataset tar shards. Each tar
sample is a block of whole documents: ``<key>.tokens.npy`` (the documents' token ids
concatenated, in the manifest's ``token_dtype``) and ``<key>.lengths.npy`` (int64
token count per document). Blocks keep the per-member tar overhead (512-byte headers)
negligible for short documents. See docs/data.md.
"""

import dataclasses
import io
import json
import os
import re
import tarfile
from pathlib import Path
from typing import List, NamedTuple, Optional

import numpy as np
import webdataset as wds
from webdataset.tariterators import tarfile_samples

FORMAT = "oryx-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
BLOCK_TOKENS = 1 << 20
HOLDOUT_FRACTION = 0.1  # documents held out of a single-shard dataset (tokens of a one-document one)


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned dtype that holds every id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Part(NamedTuple):
    """A part (split) of a dataset: documents ``[first, end)`` (numbered over the shards in
    order), from token ``start`` of document ``first`` to token ``stop`` of document ``end - 1``
    (None: its end). Only the one-document holdout cuts a document."""

    first: int
    end: int
    start: int = 0
    stop: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the manifest's directory
    documents: int
    tokens: int


@dataclasses.dataclass
class Manifest:
    """What the loader needs to know about a dataset, plus provenance."""

    tokenizer: dict  # kind, file, sha256, eod_token
    vocab_size: int
    eod_id: int
    token_dtype: str
    shards: List[ShardInfo]
    stats: dict  # documents, tokens and the counted skips of the prep run
    root: Path = dataclasses.field(default=Path("."), compare=False)  # the manifest's directory

    @property
    def documents(self) -> int:
        return sum(s.documents for s in self.shards)

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.shards)

    def shard_path(self, shard: ShardInfo) -> Path:
        return self.root / shard.path

    def holdout(self, holdout_shards: int, split: str, min_tokens: int = 1, tail: bool = True) -> Part:
        """The "train" or the held-out "valid" part of this dataset: the last ``holdout_shards``
        shards (one at least left for training); in a dataset of a single shard, the last
        ``HOLDOUT_FRACTION`` of its documents (at least one, one at least left for training);
        in a dataset of one document, the tail of it: ``HOLDOUT_FRACTION`` of its tokens, at
        least ``min_tokens`` (one sample), at least ``min_tokens`` left for training, or, with
        ``tail=False`` (a run without evaluation), nothing."""
        if split not in ("train", "valid"):
            raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
        if len(self.shards) > 1:
            if not 1 <= holdout_shards < len(self.shards):
                raise ValueError(
                    f"{self.root / MANIFEST}: holdout_shards={holdout_shards} must be between 1 and "
                    f"{len(self.shards) - 1} ({len(self.shards)} shards, one at least for training)"
                )
            cut = sum(s.documents for s in self.shards[:len(self.shards) - holdout_shards])
        elif self.documents == 1:
            return self._tail_holdout(split, min_tokens, tail)
        else:
            cut = self.documents - min(self.documents - 1, max(1, round(self.documents * HOLDOUT_FRACTION)))
        return Part(0, cut) if split == "train" else Part(cut, self.documents)

    def _tail_holdout(self, split: str, min_tokens: int, tail: bool) -> Part:
        """``holdout`` of a dataset of one document: a token range at its end (or nothing)."""
        if not tail:
            if split == "valid":
                raise ValueError(f"{self.root / MANIFEST}: its one document is not split (a run without "
                                 f"evaluation): there is no held-out data")
            return Part(0, 1)
        held_out = max(min_tokens, round(self.tokens * HOLDOUT_FRACTION))
        if self.tokens - held_out < min_tokens:
            raise ValueError(f"{self.root / MANIFEST}: its one document of {self.tokens} tokens is too short to hold "
                             f"out a tail: training and held-out data need {min_tokens} tokens each")
        cut = self.tokens - held_out
        return Part(0, 1, stop=cut) if split == "train" else Part(0, 1, start=cut)

    def write(self, path: Path) -> None:
        """Write atomically (tmp file + rename)."""
        body = {"format": FORMAT, "version": VERSION, **dataclasses.asdict(self)}
        del body["root"]
        tmp = Path(f"{path}.tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path) -> "Manifest":
        """Read a manifest file, or ``manifest.json`` in a directory; errors name the file and field."""
        path = Path(path)
        if path.is_dir():
            path = path / MANIFEST
        try:
            body = json.loads(path.read_text())
        except OSError as e:
            raise FileNotFoundError(f"cannot read manifest {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest {path} is not valid JSON: {e}") from None
        if body.get("format") != FORMAT or body.get("version") != VERSION:
            raise ValueError(
                f"manifest {path}: format {body.get('format')!r} version {body.get('version')!r}, "
                f"expected {FORMAT!r} version {VERSION}"
            )
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "root"]
        missing = [f for f in fields if f not in body]
        if missing:
            raise ValueError(f"manifest {path} has no field {missing[0]!r}")
        try:
            shards = [ShardInfo(**s) for s in body["shards"]]
        except TypeError as e:
            raise ValueError(f"manifest {path}: bad entry in 'shards': {e}") from None
        if not shards:
            raise ValueError(f"manifest {path} lists no shards")
        return cls(**{f: body[f] for f in fields if f != "shards"}, shards=shards, root=path.parent)


class ShardWriter:
    """Writes documents into one tar shard; the file appears (atomic rename) on ``close``."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self._tmp = Path(f"{path}.tmp")
        self._tar = wds.TarWriter(str(self._tmp), mtime=0, user="", group="", mode=0o644)
        self._docs: List[np.ndarray] = []
        self._block_tokens = 0
        self._blocks = self.documents = self.tokens = 0

    def add(self, ids: np.ndarray) -> None:
        self._docs.append(ids.astype(self.dtype, copy=False))
        self._block_tokens += len(ids)
        self.documents += 1
        self.tokens += len(ids)
        if self._block_tokens >= BLOCK_TOKENS:
            self._flush()

    def _flush(self) -> None:
        if self._docs:
            self._tar.write({
                "__key__": f"{self._blocks:06d}",
                "tokens.npy": np.concatenate(self._docs),
                "lengths.npy": np.array([len(d) for d in self._docs], np.int64),
            })
            self._blocks += 1
        self._docs, self._block_tokens = [], 0

    def close(self) -> ShardInfo:
        self._flush()
        self._tar.close()
        os.replace(self._tmp, self.path)
        return ShardInfo(self.path.name, self.documents, self.tokens)


# The header np.save writes for a 1-D array (format 1.0: magic, version, 2-byte length, then this dict).
_NPY_1D_HEADER = re.compile(rb"\{'descr': '([<>|=][a-z]\d+)', 'fortran_order': False, 'shape': \((\d+),\), \}\s*")


def read_npy(data: bytes) -> np.ndarray:
    """``np.load`` of a shard member, a 1-D array in np.save's format 1.0, without numpy's header parser: that
    parser is ``ast.literal_eval``, which on CPython < 3.11.8 can fail with a spurious "SystemError: AST
    constructor recursion depth mismatch" when a garbage collection releases the GIL mid-parse (cpython
    gh-106905), as it did in a loader worker. Any other header goes to ``np.load``."""
    header = _NPY_1D_HEADER.fullmatch(data[10:10 + int.from_bytes(data[8:10], "little")])
    if data[:8] != b"\x93NUMPY\x01\x00" or header is None:
        return np.load(io.BytesIO(data))
    return np.frombuffer(data, np.dtype(header[1].decode()), int(header[2]),
                         10 + int.from_bytes(data[8:10], "little"))


def read_documents(path) -> List[np.ndarray]:
    """The documents of one shard, in order (views into the blocks' token arrays)."""
    docs = []
    try:
        for sample in tarfile_samples([{"url": str(path)}]):
            tokens = read_npy(sample["tokens.npy"])
            lengths = read_npy(sample["lengths.npy"])
            if lengths.sum() != len(tokens):
                raise ValueError(f"block {sample['__key__']!r}: lengths do not add up to the token count")
            docs.extend(np.split(tokens, np.cumsum(lengths)[:-1]))
    except KeyError as e:
        raise ValueError(f"cannot read shard {path}: a block has no {e.args[0]!r} member") from None
    except (tarfile.TarError, OSError, ValueError) as e:  # webdataset appends its stream to e.args
        raise ValueError(f"cannot read shard {path}: {e.args[0] if e.args else e!r}") from None
    return docs
