"""Tokenizers: a HF ``tokenizers`` file (real runs), a byte-level BPE trainer, and a
byte tokenizer for tests. Nothing is ever downloaded."""

import hashlib
from pathlib import Path
from typing import Iterable, List, Union

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from oryx_megatron.data_prep import PrepError

EOD_TOKEN = "<|endoftext|>"


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255 and end-of-document 256: no files, no training."""

    vocab_size = 257
    eod_id = 256

    def encode_batch(self, texts: List[str]) -> List[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", "replace")

    def identity(self) -> dict:
        return {"kind": "byte", "sha256": hashlib.sha256(b"oryx byte tokenizer v1").hexdigest(), "eod_token": None}


class HFTokenizer:
    """A ``tokenizer.json`` of the HF ``tokenizers`` library; documents are encoded without
    special tokens (the loader adds the EOD token between documents)."""

    def __init__(self, path, eod_token: str = EOD_TOKEN):
        self.path = Path(path)
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
            self.sha256 = hashlib.sha256(self.path.read_bytes()).hexdigest()
        except Exception as e:  # tokenizers raises bare Exceptions for bad files
            raise PrepError(f"cannot load tokenizer {path}: {e}") from None
        self.eod_token = eod_token
        self.eod_id = self._tokenizer.token_to_id(eod_token)
        if self.eod_id is None:
            raise PrepError(f"tokenizer {path} has no end-of-document token {eod_token!r}; name one with --eod-token")
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: List[str]) -> List[np.ndarray]:
        return [np.array(e.ids, np.int64) for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def identity(self) -> dict:
        return {"kind": "hf", "sha256": self.sha256, "eod_token": self.eod_token}


AnyTokenizer = Union[ByteTokenizer, HFTokenizer]


def load_tokenizer(spec: str, eod_token: str = EOD_TOKEN) -> AnyTokenizer:
    """``"byte"`` or the path of a ``tokenizer.json``."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec, eod_token)


def train_bpe(texts: Iterable[str], vocab_size: int, out: Path) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization, no unknown tokens) with
    ``<|endoftext|>`` as its only special token, save it to ``out`` and load it back."""
    if vocab_size < 257:
        raise PrepError(f"vocab size {vocab_size} is too small for a byte-level BPE (at least 257)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tokenizer.train_from_iterator(texts, trainer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out))
    return HFTokenizer(out)
