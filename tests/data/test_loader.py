import json
import shutil

import numpy as np
import pytest
import torch

from oryx_megatron.data.loader import ShardLoader, parse_blend
from oryx_megatron.data.modes import random_chunks
from oryx_megatron.data.shards import Manifest, ShardWriter

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
    rows = torch.cat([b["tokens"] for b in batches]), torch.cat([b["labels"] for b in batches])
    assert (rows[0][1:, 0] == rows[1][:-1, -1]).all()  # windows overlap by one token
    assert loader.consumed_samples == 24 and loader.eod_id == 256 and loader.vocab_size == 257


def test_same_seed_same_batches_across_runs_and_worker_counts(dataset, second_dataset):
    blend = [0.6, dataset.root, 0.4, second_dataset.root]
    reference = _take(_loader(blend), 40)
    assert _same(reference, _take(_loader(blend), 40))
    with_workers = _loader(blend, num_workers=2)
    assert _same(reference, _take(with_workers, 40))
    with_workers.close()
    assert not _same(reference, _take(_loader(blend, seed=8), 40))


def _documents(tokens, eod):
    return " ".join(map(str, tokens)).split(f" {eod}")


def test_dp_ranks_read_disjoint_data_that_covers_the_epoch(dataset):
    per_rank = (dataset.tokens + dataset.documents) // 2  # 2 shards of 10 equal documents per rank
    seen = []
    for rank in (0, 1):
        loader, tokens = _loader(dataset.root, dp_rank=rank, dp_size=2), []
        while len(tokens) < per_rank:
            tokens += next(loader)["tokens"].flatten().tolist()
        docs = _documents(tokens[:per_rank], dataset.eod_id)
        assert docs[-1] == "" and len(docs) == 21
        seen.append(set(docs[:-1]))
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == dataset.documents


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
    assert state["consumed_samples"] == 60 and state["source_samples"] == [15, 15]
    new = _loader(blend, dp_rank=3, dp_size=4)
    new.load_state_dict(state)
    assert new.state_dict()["source_samples"] == [7, 7]  # same overall depth: 2 x 15 = 4 x 7.5
    batch = next(new)
    assert torch.equal(batch["modes"], random_chunks(8, 0.5).batch(32, range(69, 72), seed=7))
    assert new.consumed_samples == 72


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
