import json

import pytest

from oryx_megatron.data_prep.inputs import InputOptions
from oryx_megatron.data_prep.pipeline import tokenize_corpus
from oryx_megatron.data_prep.tokenizer import ByteTokenizer

DOC_CHARS = 40
LINE_BYTES = len(json.dumps({"text": "x" * DOC_CHARS})) + 1


def unique_docs(prefix: str, n: int):
    """n distinct documents of DOC_CHARS characters each."""
    return [f"{prefix}-{i:05d} ".ljust(DOC_CHARS, "abcdefgh"[i % 8]) for i in range(n)]


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def prepare(tmp_path, docs, docs_per_shard, name="corpus", workers=1, tokenizer=None):
    """Byte-tokenized dataset of equal-length docs, ``docs_per_shard`` documents in every shard."""
    src = write_jsonl(tmp_path / f"{name}.jsonl", docs)
    return tokenize_corpus([src], tmp_path / name, tokenizer or ByteTokenizer(),
                           shard_bytes=docs_per_shard * LINE_BYTES, workers=workers, options=InputOptions(),
                           progress=False)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    """40 distinct documents in 4 shards of 10."""
    manifest = prepare(tmp_path_factory.mktemp("data"), unique_docs("doc", 40), 10)
    assert len(manifest.shards) == 4
    return manifest


@pytest.fixture(scope="session")
def second_dataset(tmp_path_factory):
    """Another source for blending: 30 documents in 3 shards."""
    return prepare(tmp_path_factory.mktemp("data2"), unique_docs("other", 30), 10, name="other")
