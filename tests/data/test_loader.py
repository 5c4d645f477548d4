import json
import shutil

import numpy as np
import pytest
import torch

from oryx_megatron.data.loader import ShardLoader, parse_blend
from oryx_megatron.data.modes import random_chunks
from oryx_megatron.data.shards import Manifest, ShardWriter, read_documents

SCHEDULE = {"name": "random_chunks", "chunk_size": 8, "p_attention": 0.5}


def _loader(data_path, **kw):
    args = dict(seq_len=32, micro_batch_size=3, seed=7, mode_schedule=SCHEDULE)
    return ShardLoader(data_path, **{**args, **kw})


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_batches_follow_the_contract(dataset):
    loader = _loader(dataset.root, dp_rank=1, dp_size=2)
    batches = _take(loader, 4)
    dtypes = {"tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
              "position_ids": torch.int64, "modes": torch.int8}
    for k, batch in enumerate(batches):
        assert {key: t.dtype for key, t in batch.items()} == dtypes
        assert all(t.shape == (3, 32) for t in batch.values())
        assert (batch["loss_mask"] == 1).all() and (batch["position_ids"] == torch.arange(32)).all()
        assert (batch["tokens"][:, 1:] == batch["labels"][:, :-1]).all()
        indices = range(k * 6 + 3, k * 6 + 6)  # global samples of rank 1's k-th micro-batch
        assert torch.equal(batch["modes"], random_chunks(8, 0.5).batch(32, indices, seed=7))
    assert loader.consumed_samples == 24 and loader.eod_id == 256 and loader.vocab_size == 257


def test_same_seed_same_batches_across_runs_and_worker_counts(dataset, second_dataset):
    blend = [0.6, dataset.root, 0.4, second_dataset.root]
    reference = _take(_loader(blend), 40)
    assert _same(reference, _take(_loader(blend), 40))
    with_workers = _loader(blend, num_workers=2)
    assert _same(reference, _take(with_workers, 40))
    with_workers.close()
    assert not _same(reference, _take(_loader(blend, seed=8), 40))


def epoch_windows(manifest, seq_len, seed, epoch, source=0):
    """The documented layout, rebuilt from the shards: the epoch's windows in stream order."""
    docs = [d for shard in manifest.shards for d in read_documents(manifest.shard_path(shard))]
    order = np.random.default_rng([seed, source, epoch, 2]).permutation(len(docs))
    stream = np.concatenate([np.append(docs[i], manifest.eod_id) for i in order])
    n = (len(stream) - 1) // seq_len
    return [tuple(stream[w * seq_len:w * seq_len + seq_len + 1].tolist()) for w in range(n)]


def _rows(batches):
    return [tuple(row) for b in batches for row in torch.cat([b["tokens"], b["labels"][:, -1:]], 1).tolist()]


def test_an_epoch_is_a_permutation_of_all_windows_of_shuffled_documents(dataset):
    windows = epoch_windows(dataset, 32, 7, epoch=0)
    assert len(windows) == (dataset.tokens + dataset.documents - 1) // 32 == 51
    rows = _rows(_take(_loader(dataset.root, micro_batch_size=3), 17))
    assert len(rows) == 51 and sorted(rows) == sorted(windows)  # the same multiset: every window once
    assert rows != windows  # visited in a shuffled order
    second = _rows(_take(_loader(dataset.root, micro_batch_size=3), 34)[17:])
    assert sorted(second) == sorted(epoch_windows(dataset, 32, 7, epoch=1)) and second != rows


def test_global_samples_do_not_depend_on_the_data_parallel_layout(dataset, second_dataset):
    blend = [0.6, dataset.root, 0.4, second_dataset.root]
    one = _rows(_take(_loader(blend, micro_batch_size=4), 10))
    for dp in (2, 4):
        ranks = [_take(_loader(blend, micro_batch_size=4 // dp, dp_rank=r, dp_size=dp), 10) for r in range(dp)]
        merged = [row for k in range(10) for r in range(dp) for row in _rows([ranks[r][k]])]
        assert merged == one


def test_resume_continues_exactly(dataset, second_dataset):
    blend = [0.3, dataset.root, 0.7, second_dataset.root]
    kw = dict(dp_rank=1, dp_size=2, num_workers=2)
    uninterrupted = _take(_loader(blend, **kw), 30)
    first = _loader(blend, **kw)
    head = _take(first, 11)
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint as plain data
    first.close()
    resumed = _loader(blend, **{**kw, "num_workers": 0})
    resumed.load_state_dict(state)
    assert _same(uninterrupted, head + _take(resumed, 19))


def test_resume_with_another_dp_size(dataset, second_dataset):
    blend = [0.5, dataset.root, 0.5, second_dataset.root]
    old = _loader(blend, dp_rank=0, dp_size=2)
    _take(old, 10)
    state = old.state_dict()
    assert state["consumed_samples"] == 60 and state["source_samples"] == [30, 30]
    new = _loader(blend, dp_rank=3, dp_size=4)
    new.load_state_dict(state)
    batch = next(new)
    assert torch.equal(batch["modes"], random_chunks(8, 0.5).batch(32, range(69, 72), seed=7))
    assert new.consumed_samples == 72
    reference = _take(_loader(blend, micro_batch_size=12), 6)[-1]  # global samples 60..71 at dp=1
    assert all(torch.equal(batch[k], reference[k][9:]) for k in batch)


def test_blend_follows_weights(dataset, second_dataset):
    loader = _loader([1, dataset.root, 3, second_dataset.root], micro_batch_size=8)
    _take(loader, 50)
    assert loader.state_dict()["source_samples"] == [100, 300]
    by_size = _loader([dataset.root, second_dataset.root], micro_batch_size=7)
    _take(by_size, 10)
    assert by_size.state_dict()["source_samples"] == [40, 30]  # 1600 : 1200 tokens


def test_parse_blend():
    assert parse_blend("a") == (["a"], None)
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["1", "a", 3, "b"]) == (["a", "b"], [0.25, 0.75])
    with pytest.raises(ValueError, match="weights and paths must alternate"):
        parse_blend([0.5, "a", "b"])
    with pytest.raises(ValueError, match="weights must be >= 0 with a positive sum"):
        parse_blend([0, "a", 0, "b"])


def test_errors_name_the_problem(dataset, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(dataset.root, copy)
    body = json.loads((copy / "manifest.json").read_text())
    body["tokenizer"]["sha256"] = "0" * 64
    (copy / "manifest.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="was tokenized with another tokenizer than"):
        _loader([dataset.root, copy])
    writer = ShardWriter(copy / "shard-000000.tar", np.uint16)
    writer.add(np.arange(20))
    writer.close()
    with pytest.raises(ValueError, match=r"shard-000000.tar holds 1 documents / 20 tokens, its manifest says 10 / 400"):
        _take(_loader(copy), 20)
    (copy / "shard-000000.tar").write_bytes(b"garbage" * 100)
    with pytest.raises(ValueError, match=r"cannot read shard .*shard-000000.tar"):
        _take(_loader(copy, num_workers=1), 20)
    with pytest.raises(FileNotFoundError, match="cannot read manifest"):
        _loader(tmp_path / "nothing")
    loader = _loader(dataset.root)
    with pytest.raises(ValueError, match="loader state has seq_len=64, this loader has seq_len=32"):
        loader.load_state_dict({**loader.state_dict(), "seq_len": 64})
    assert Manifest.read(dataset.root) == dataset


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.int64])
@pytest.mark.parametrize("length", [0, 1, 4097])
def test_shard_members_are_read_without_numpys_header_parser(dtype, length, monkeypatch):
    """read_npy gives np.load's array without ast.literal_eval (CPython < 3.11.8's SystemError under threads);
    other headers (here 2-D) still go to np.load."""
    import ast
    import io

    from oryx_megatron.data.shards import read_npy

    def saved(array):
        buffer = io.BytesIO()
        np.save(buffer, array)
        return buffer.getvalue()

    one_d = np.arange(length).astype(dtype)
    two_d = np.arange(6, dtype=dtype).reshape(2, 3)
    monkeypatch.setattr(ast, "literal_eval", lambda _: pytest.fail("np.load's header parser was called"))
    got = read_npy(saved(one_d))
    assert got.dtype == one_d.dtype and np.array_equal(got, one_d)
    monkeypatch.undo()
    assert np.array_equal(read_npy(saved(two_d)), two_d)
