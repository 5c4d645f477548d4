"""Document boundaries (``data.reset_at_eod``): ``document_ids`` of every loader, against a corpus
of documents of known lengths, and unchanged batches without the flag."""

import json
import shutil

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from oryx_megatron.data.documents import document_ids
from oryx_megatron.data.indexed import IndexedLoader
from oryx_megatron.data.loader import ShardLoader
from oryx_megatron.data.synthetic import MQARLoader
from oryx_megatron.run_config import ConfigError
from oryx_megatron.training.builders import build_loader
from oryx_megatron.training.validation import validate_run
from tests.data.conftest import prepare
from tests.test_train import run_config

EOD = 256  # the byte tokenizer's
SEQ, CHUNK = 32, 8
SCHEDULE = {"name": "random_chunks", "chunk_size": CHUNK, "p_attention": 0.5}
# Documents shorter than a chunk (1, 2, 3, 5, 7), one of a chunk (8), longer than a sample (33-70).
LENGTHS = [3, 45, 12, 1, 70, 8, 20, 5, 33, 2, 16, 40, 7, 29]
WINDOWS = (sum(LENGTHS) + len(LENGTHS) - 1) // SEQ  # samples per epoch: 9
OLD_KEYS = ["tokens", "labels", "loss_mask", "position_ids", "modes"]


def _texts():
    return ["abcdefghijklmn"[k] * n for k, n in enumerate(LENGTHS)]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """The documents of LENGTHS as token shards (several shards) and as Megatron .bin/.idx."""
    root = tmp_path_factory.mktemp("documents")
    manifest = prepare(root, _texts(), 4)
    assert len(manifest.shards) > 1 and manifest.documents == len(LENGTHS) and manifest.eod_id == EOD
    builder = IndexedDatasetBuilder(str(root / "indexed.bin"), dtype=np.uint16)
    for text in _texts():
        builder.add_item(torch.tensor([*text.encode(), EOD]))
        builder.end_document()
    builder.finalize(str(root / "indexed.idx"))
    return {"shards": str(manifest.root), "indexed": str(root / "indexed")}


def _shards(path, **kw):
    return ShardLoader(path, **{**dict(seq_len=SEQ, micro_batch_size=3, seed=7, mode_schedule=SCHEDULE), **kw})


def _indexed(path, **kw):
    args = dict(seq_len=SEQ, micro_batch_size=2, num_samples=24, eod_id=EOD, seed=3, mode_schedule=SCHEDULE)
    return IndexedLoader(path, **{**args, **kw})


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(list(x) == list(y) and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


def _exclusive_eod_count(tokens: torch.Tensor) -> np.ndarray:
    """The interface's formula, written out: document_ids[:, t] = #EOD in tokens[:, :t]."""
    eod = tokens.numpy() == EOD
    return np.array([[eod[b, :t].sum() for t in range(eod.shape[1])] for b in range(eod.shape[0])])


def _runs(ids: np.ndarray):
    """Lengths of the runs of equal ids of one row: (first, interior..., last)."""
    return np.diff(np.flatnonzero(np.diff(ids, prepend=-1, append=-1)))


def test_document_ids_count_the_eod_tokens_before_each_position():
    tokens = torch.tensor([[5, 9, 9, 3, 9, 7], [9, 1, 2, 3, 4, 9]])
    ids = document_ids(tokens, 9)
    assert ids.dtype == torch.int32 and ids.tolist() == [[0, 0, 1, 2, 2, 3], [0, 1, 1, 1, 1, 1]]
    assert document_ids(tokens[0], 9).tolist() == ids[0].tolist()  # any leading dims
    assert document_ids(tokens, 4).tolist() == [[0] * 6, [0, 0, 0, 0, 0, 1]]


def test_shard_loader_document_ids_follow_the_document_lengths(documents):
    """Every row of two epochs against the documented layout (document and window orders of
    the seed) and LENGTHS: the id of a token is its document's rank in the window."""
    batches = _take(_shards(documents["shards"], reset_at_eod=True), 2 * WINDOWS // 3)
    lengths = np.array(LENGTHS)
    crossing = short = 0
    for k, batch in enumerate(batches):
        assert list(batch) == OLD_KEYS + ["document_ids"]
        ids = batch["document_ids"]
        assert ids.dtype == torch.int32 and ids.shape == (3, SEQ)
        assert np.array_equal(ids.numpy(), _exclusive_eod_count(batch["tokens"]))
        for row, sample in enumerate(range(3 * k, 3 * k + 3)):
            epoch, j = divmod(sample, WINDOWS)
            order = np.random.default_rng([7, 0, epoch, 2]).permutation(len(LENGTHS))
            start = np.random.default_rng([7, 0, epoch, 3]).permutation(WINDOWS)[j] * SEQ
            ends = np.cumsum(lengths[order] + 1)  # each document, then its EOD
            document = np.searchsorted(ends, start + np.arange(SEQ), "right")  # of each position
            assert ids[row].tolist() == (document - document[0]).tolist()
            runs = _runs(ids[row].numpy())
            assert sorted(runs[1:-1]) == sorted(lengths[order][document[0] + 1:document[-1]] + 1)
            crossing += int(ends[document[0]] - start < lengths[order][document[0]] + 1)
            short += int(any(lengths[order][d] < CHUNK for d in np.unique(document)[1:-1]))
    assert crossing >= 8 and short >= 2  # rows that begin inside a document, rows holding whole short ones


def test_without_reset_at_eod_batches_are_unchanged(documents):
    for build, path in ((_shards, documents["shards"]), (_indexed, documents["indexed"])):
        plain, reset = _take(build(path), 6), _take(build(path, reset_at_eod=True), 6)
        assert all(list(b) == OLD_KEYS for b in plain)
        assert _same(plain, [{k: v for k, v in b.items() if k != "document_ids"} for b in reset])
    plain, reset = (_take(MQARLoader(seq_len=48, micro_batch_size=3, vocab_size=64, num_pairs=4, seed=7,
                                     reset_at_eod=flag), 2) for flag in (False, True))
    assert _same(plain, [{k: v for k, v in b.items() if k != "document_ids"} for b in reset])
    assert all(b["document_ids"].dtype == torch.int32 and not b["document_ids"].any() for b in reset)  # one document


def test_shard_document_ids_do_not_depend_on_workers_resume_or_the_dp_layout(documents):
    path = documents["shards"]
    whole = _take(_shards(path, micro_batch_size=4, reset_at_eod=True), 8)
    ranks = []
    for r in (0, 1):  # rank 1 reads its shards in a worker process
        with _shards(path, micro_batch_size=2, dp_rank=r, dp_size=2, reset_at_eod=True, num_workers=r) as loader:
            ranks.append(_take(loader, 8))
    for k, batch in enumerate(whole):
        for key in batch:
            assert torch.equal(batch[key], torch.cat([ranks[0][k][key], ranks[1][k][key]]))
    first = _shards(path, micro_batch_size=4, reset_at_eod=True, num_workers=2)
    head = _take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = _shards(path, micro_batch_size=2, dp_rank=1, dp_size=2, reset_at_eod=True)
    resumed.load_state_dict(state)
    assert _same(head, whole[:3])
    assert all(torch.equal(b["document_ids"], w["document_ids"][2:]) for b, w in zip(_take(resumed, 5), whole[3:]))


def test_indexed_document_ids_follow_megatrons_samples(documents):
    """GPTDataset's samples (its own packing) and the formula; interior documents are whole
    documents of LENGTHS; the same at every layout, with workers, and after a resume."""
    loader = _indexed(documents["indexed"], reset_at_eod=True)
    batches = list(loader)
    interior = []
    for k, batch in enumerate(batches):
        assert torch.equal(batch["document_ids"], document_ids(batch["tokens"], EOD))
        assert np.array_equal(batch["document_ids"].numpy(), _exclusive_eod_count(batch["tokens"]))
        for row in range(2):
            assert torch.equal(batch["tokens"][row], loader.dataset[2 * k + row]["tokens"])
            interior += _runs(batch["document_ids"][row].numpy())[1:-1].tolist()
    assert interior and set(interior) <= {n + 1 for n in LENGTHS}
    ranks = [list(_indexed(documents["indexed"], micro_batch_size=1, dp_rank=r, dp_size=2, reset_at_eod=True,
                           num_workers=r)) for r in (0, 1)]
    assert all(torch.equal(b[key], torch.cat([ranks[0][k][key], ranks[1][k][key]]))
               for k, b in enumerate(batches) for key in b)
    first = _indexed(documents["indexed"], reset_at_eod=True)
    head = _take(first, 5)
    resumed = _indexed(documents["indexed"], reset_at_eod=True)
    resumed.load_state_dict(first.state_dict())
    assert _same(batches, head + list(resumed))


@pytest.mark.parametrize("data", ["shards", "indexed", "mqar"])
def test_data_reset_at_eod_reaches_every_loader(documents, tmp_path, single_process_parallel, data):
    extra = ["data=mqar", "data.seq_length=64"] if data == "mqar" else []
    for flag in (False, True):
        run = run_config(documents, tmp_path, "train.train_iters=2", f"data.reset_at_eod={str(flag).lower()}", *extra,
                         indexed=data == "indexed")
        assert run.data.reset_at_eod is flag
        with build_loader(run) as loader:
            batch = next(loader)
        assert list(batch) == OLD_KEYS + ["document_ids"] * flag
        if flag:
            expected = torch.zeros_like(batch["tokens"]) if data == "mqar" else document_ids(batch["tokens"], EOD)
            assert torch.equal(batch["document_ids"], expected.int())


def test_reset_at_eod_without_an_eod_id_is_a_config_error(documents, tmp_path):
    copy = tmp_path / "no_eod"
    shutil.copytree(documents["shards"], copy)
    body = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**body, "eod_id": None}))
    with pytest.raises(ConfigError) as error:
        validate_run(run_config({"shards": str(copy)}, tmp_path, "train.train_iters=2", "data.reset_at_eod=true"),
                     world_size=1)
    assert str(error.value) == (f"config key 'data.reset_at_eod': {copy} has no EOD id in [0, 257) "
                                f"(manifest eod_id: None)")
