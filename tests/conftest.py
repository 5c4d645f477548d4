import os
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import tests.mixers  # noqa: E402, F401  (registers the tests' linear mixers and their ops before collection)
from tests import plugins  # noqa: E402


def pytest_configure(config):
    """The tests' mixer plugins (or, with ORYX_TEST_PLUGIN, the plugin at that path instead: ``make proofs
    PLUGIN=``), pip-installed into a target of this session before collection: the proofs of every registered
    mixer run for them, and every process a test starts finds them through their entry point."""
    config.plugin_target = Path(tempfile.mkdtemp(prefix="oryx-plugins-"))
    plugins.install(config.plugin_target, os.environ.get("ORYX_TEST_PLUGIN") or None)


def pytest_unconfigure(config):
    shutil.rmtree(config.plugin_target, ignore_errors=True)


@pytest.fixture(scope="session")
def single_process_parallel():
    """A world of one with megatron's parallel state (TP = PP = 1)."""
    from oryx_megatron.parallel import initialize_parallel

    initialize_parallel()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops run fastest single-threaded; oversubscribed threads slow CPU convs 30x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Byte-tokenized standard-library sources: 4 shards (the last one held out), and the same
    documents as a Megatron .bin/.idx dataset (whose samples do not depend on the layout)."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from oryx_megatron.data_prep.inputs import InputOptions, stdlib_files
    from oryx_megatron.data_prep.pipeline import tokenize_corpus
    from oryx_megatron.data_prep.tokenizer import ByteTokenizer

    root = tmp_path_factory.mktemp("corpus")
    files = stdlib_files()[:60]
    manifest = tokenize_corpus(files, root / "shards", ByteTokenizer(), shard_bytes=sum(f.stat().st_size for f in files) // 4,
                               workers=1, options=InputOptions(), progress=False)
    builder = IndexedDatasetBuilder(str(root / "indexed.bin"), dtype=np.uint16)
    for f in files:
        builder.add_item(torch.from_numpy(np.append(np.frombuffer(f.read_bytes(), np.uint8), 256).astype(np.int64)))
        builder.end_document()
    builder.finalize(str(root / "indexed.idx"))
    return {"shards": str(root / "shards"), "indexed": str(root / "indexed"), "shard_count": len(manifest.shards)}


SHORT_DOCUMENT_LENGTHS = (5, 12, 1, 30, 8, 3, 61, 15, 2, 20)  # bytes, cycled: ~4 documents start in a window
SHORT_DOCUMENTS = 1000


@pytest.fixture(scope="session")
def short_documents(tmp_path_factory):
    """The corpus's first sources (ASCII, whitespace runs made one space) cut into SHORT_DOCUMENTS documents of
    SHORT_DOCUMENT_LENGTHS bytes (none starts with a space: none is blank) as 4 token shards (the last one held
    out): packed windows of 64 tokens hold EODs at many positions, which depend on the lengths only, not on the
    interpreter's sources."""
    from oryx_megatron.data_prep.inputs import InputOptions, stdlib_files
    from oryx_megatron.data_prep.pipeline import tokenize_corpus
    from oryx_megatron.data_prep.tokenizer import ByteTokenizer
    from tests.data.conftest import write_jsonl

    root = tmp_path_factory.mktemp("short_documents")
    text = " ".join(bytes(b for f in stdlib_files()[:20] for b in f.read_bytes() if b < 128).decode("ascii").split())
    documents, start = [], 0
    while len(documents) < SHORT_DOCUMENTS:
        start += text[start] == " "
        length = SHORT_DOCUMENT_LENGTHS[len(documents) % len(SHORT_DOCUMENT_LENGTHS)]
        documents.append(text[start:start + length])
        start += length
    source = write_jsonl(root / "documents.jsonl", documents)
    manifest = tokenize_corpus([source], root / "shards", ByteTokenizer(), shard_bytes=source.stat().st_size // 4 + 1,
                               workers=1, options=InputOptions(), progress=False)
    lengths = SHORT_DOCUMENT_LENGTHS * (SHORT_DOCUMENTS // len(SHORT_DOCUMENT_LENGTHS))
    assert (manifest.documents, manifest.tokens) == (SHORT_DOCUMENTS, sum(lengths))
    assert len(manifest.shards) == 4 and all(shard.documents for shard in manifest.shards)
    return {"shards": str(root / "shards")}


def trained_checkpoint(corpus, tmp_path_factory, name: str, *overrides: str) -> str:
    """The checkpoint.dir of a tiny run (seq 64, byte vocab; tests/test_train.py's) with ``overrides``."""
    from oryx_megatron.training.loop import pretrain
    from tests.test_train import run_config

    tmp = tmp_path_factory.mktemp(name)
    run = run_config(corpus, tmp, *overrides, "checkpoint.save_at_end=true")
    assert pretrain(run, str(tmp / "out")) == 0
    return str(tmp / "ckpt")


@pytest.fixture(scope="session")
def tiny_checkpoint(corpus, tmp_path_factory):
    """A run's checkpoint.dir after 20 iterations of the tiny Oryx-TG."""
    return trained_checkpoint(corpus, tmp_path_factory, "tiny_ckpt", "train.train_iters=20", "optimizer.lr=1e-2")


@pytest.fixture(scope="session")
def transformer_checkpoint(corpus, tmp_path_factory):
    """A run's checkpoint.dir after 4 iterations of the tiny Transformer baseline."""
    return trained_checkpoint(corpus, tmp_path_factory, "transformer_ckpt", "model.family=transformer",
                              "train.train_iters=4")
