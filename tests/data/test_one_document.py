"""A corpus of one document (one file through ``oryx-prep tokenize FILE``) trains: with evaluation it
holds out the tail of the document, without it nothing; validation decides and logs it first."""

import logging

import numpy as np
import pytest

from oryx_megatron.cli.prep import main as oryx_prep
from oryx_megatron.data.loader import ShardLoader
from oryx_megatron.data.shards import Manifest, Part, read_documents
from oryx_megatron.run_config import ConfigError
from oryx_megatron.training.builders import build_loader
from oryx_megatron.training.loop import pretrain
from oryx_megatron.training.validation import validate_run
from tests.data.conftest import prepare, unique_docs
from tests.test_train import losses, run_config

SEQ = 64  # tests.test_train's TINY_TRAIN
SOURCE = "".join(f"def f_{i:03d}(x):\n    return x + {i:03d}\n\n" for i in range(100))  # 3,400 bytes
HELD_OUT = 340  # 10% of the tokens (at least one sample of SEQ)


def _tokenize(tmp_path, text, name):
    (tmp_path / f"{name}.py").write_text(text)
    assert oryx_prep(["tokenize", str(tmp_path / f"{name}.py"), "--tokenizer", "byte", "--out",
                      str(tmp_path / name), "--workers", "1"]) == 0
    return Manifest.read(tmp_path / name)


@pytest.fixture(scope="module")
def one_document(tmp_path_factory):
    manifest = _tokenize(tmp_path_factory.mktemp("one"), SOURCE, "functions")
    assert (manifest.documents, manifest.tokens) == (1, len(SOURCE))
    return manifest


def _validated(one_document, tmp_path, caplog, *overrides):
    run = run_config({"shards": str(one_document.root)}, tmp_path, *overrides)
    with caplog.at_level(logging.INFO, logger="oryx_megatron.training.validation"):
        validate_run(run, world_size=1)
    return run, [r.getMessage() for r in caplog.records if r.name == "oryx_megatron.training.validation"]


def _split_sizes(run, split):
    """[documents, tokens] of the run's loader of ``split`` (what validation logged is what it reads)."""
    with build_loader(run, split=split) as loader:
        return loader.state_dict()["sources"]


def test_the_tail_of_the_document_is_held_out(one_document):
    cut = len(SOURCE) - HELD_OUT
    assert one_document.holdout(1, "train", min_tokens=SEQ) == Part(0, 1, stop=cut)
    assert one_document.holdout(1, "valid", min_tokens=SEQ) == Part(0, 1, start=cut)
    assert one_document.holdout(1, "valid", min_tokens=500) == Part(0, 1, start=len(SOURCE) - 500)  # one sample
    assert one_document.holdout(1, "train", min_tokens=SEQ, tail=False) == Part(0, 1)
    with pytest.raises(ValueError, match="its one document is not split .*: there is no held-out data"):
        one_document.holdout(1, "valid", min_tokens=SEQ, tail=False)
    (document,) = read_documents(one_document.shard_path(one_document.shards[0]))
    for split, piece in (("train", document[:cut]), ("valid", document[cut:])):
        loader = ShardLoader(one_document.root, seq_len=SEQ, micro_batch_size=1, holdout_shards=1, split=split)
        stream = np.append(piece, one_document.eod_id)
        windows = sorted(tuple(stream[w * SEQ:w * SEQ + SEQ + 1]) for w in range(len(piece) // SEQ))
        rows = [next(loader) for _ in windows]
        assert sorted(tuple(r["tokens"][0].tolist()) + (int(r["labels"][0, -1]),) for r in rows) == windows
        assert loader.state_dict()["sources"] == [[1, len(piece)]]


def test_a_one_document_corpus_trains_and_evaluates_on_its_tail(one_document, tmp_path, caplog,
                                                                 single_process_parallel):
    run, lines = _validated(one_document, tmp_path, caplog, "train.train_iters=2", "train.eval_interval=2",
                            "train.eval_iters=1")
    assert lines == [f"held-out data: {one_document.root}: the last {HELD_OUT} of the 3,400 tokens of its one "
                     f"document (too few documents to hold out)"]
    assert [_split_sizes(run, "train"), _split_sizes(run, "valid")] == [[[1, 3400 - HELD_OUT]], [[1, HELD_OUT]]]
    assert pretrain(run, str(tmp_path / "out")) == 0
    assert len(losses(tmp_path / "out")) == 2 and len(losses(tmp_path / "out", "eval/loss_all_attention")) == 1


def test_a_one_document_corpus_trains_on_all_of_it_without_evaluation(one_document, tmp_path, caplog,
                                                                      single_process_parallel):
    run, lines = _validated(one_document, tmp_path, caplog, "train.train_iters=2")  # train.eval_interval=null
    assert lines == [f"held-out data: {one_document.root}: nothing (one document; train.eval_interval=null): "
                     f"all 3,400 tokens train"]
    assert _split_sizes(run, "train") == [[1, 3400]]
    with pytest.raises(ValueError, match="there is no held-out data"):  # oryx-eval of such a run: nothing to read
        _split_sizes(run, "valid")
    assert pretrain(run, str(tmp_path / "out")) == 0
    assert len(losses(tmp_path / "out")) == 2


def test_a_document_too_short_to_hold_out_a_tail_is_a_config_error(tmp_path, caplog):
    manifest = _tokenize(tmp_path, "x = 1\n" * 20, "short")  # 120 tokens: no room for 2 samples of 64
    with pytest.raises(ConfigError) as error:
        _validated(manifest, tmp_path, caplog, "train.train_iters=2", "train.eval_interval=2")
    assert str(error.value) == (
        f"config key 'train.eval_interval': {manifest.root}/manifest.json: its one document of 120 tokens is too "
        f"short to hold out a tail: training and held-out data need 64 tokens each (data.seq_length=64); "
        f"train.eval_interval=null trains on all of it")
    _validated(manifest, tmp_path, caplog, "train.train_iters=2")  # without evaluation it trains
    tiny = _tokenize(tmp_path, "x = 1\n" * 5, "tiny")
    with pytest.raises(ConfigError, match=r"^config key 'data.seq_length': .*tiny holds 30 tokens in 1 document\(s\), "
                                          r"no sample of 64 \+ 1 tokens$"):
        _validated(tiny, tmp_path, caplog, "train.train_iters=2")


def test_validation_logs_what_every_source_holds_out(one_document, dataset, tmp_path, caplog):
    single_shard = prepare(tmp_path, unique_docs("single", 20), 1000, name="single")
    blend = f"[{dataset.root},{single_shard.root},{one_document.root}]"
    _, lines = _validated(one_document, tmp_path, caplog, "train.train_iters=2", "train.eval_interval=2",
                          f"data.data_path={blend}")
    assert lines == [f"held-out data: {dataset.root}: the last 1 of 4 shards (10 documents); {single_shard.root}: "
                     f"the last 2 of the 20 documents of its one shard; {one_document.root}: the last {HELD_OUT} "
                     f"of the 3,400 tokens of its one document (too few documents to hold out)"]
