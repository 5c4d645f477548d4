import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from oryx_megatron.data.indexed import IndexedLoader
from oryx_megatron.data.modes import random_chunks

EOD = 99


@pytest.fixture(scope="module")
def blend(tmp_path_factory):
    """Two Megatron .bin/.idx datasets of random documents, weighted 0.3 / 0.7."""
    root = tmp_path_factory.mktemp("indexed")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        builder = IndexedDatasetBuilder(str(root / f"{name}.bin"), dtype=np.uint16)
        for _ in range(80):
            doc = rng.integers(0, EOD, rng.integers(5, 60))
            builder.add_item(torch.from_numpy(np.append(doc, EOD)))
            builder.end_document()
        builder.finalize(str(root / f"{name}.idx"))
    return [0.3, str(root / "a"), 0.7, str(root / "b")]


def _loader(blend, **kw):
    args = dict(seq_len=24, micro_batch_size=2, num_samples=120, eod_id=EOD, seed=3,
                mode_schedule={"name": "random_chunks", "chunk_size": 8})
    return IndexedLoader(blend, **{**args, **kw})


def _same(a, b):
    return len(a) == len(b) and all(all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b))


def test_batches_are_megatrons_samples_plus_modes(blend):
    loader = _loader(blend, dp_rank=1, dp_size=2)
    batches = list(loader)
    assert len(batches) == 30 and loader.consumed_samples == 120  # 120 global samples / (2 x 2)
    for k, batch in enumerate(batches[:5]):
        assert {key: t.dtype for key, t in batch.items()} == {
            "tokens": torch.int64, "labels": torch.int64, "loss_mask": torch.float32,
            "position_ids": torch.int64, "modes": torch.int8}
        indices = range(4 * k + 2, 4 * k + 4)
        for row, index in zip(range(2), indices):
            sample = loader.dataset[index]
            assert torch.equal(batch["tokens"][row], sample["tokens"]) and torch.equal(batch["labels"][row], sample["labels"])
        assert torch.equal(batch["modes"], random_chunks(8).batch(24, indices, seed=3))


def test_resume_and_workers_match_an_uninterrupted_run(blend):
    uninterrupted = list(_loader(blend))
    first = _loader(blend, num_workers=2)
    head = [next(first) for _ in range(13)]
    resumed = _loader(blend)
    resumed.load_state_dict(first.state_dict())
    assert _same(uninterrupted, head + list(resumed))
    with pytest.raises(ValueError, match="loader state has seed=4, this loader has seed=3"):
        resumed.load_state_dict({**first.state_dict(), "seed": 4})


def test_dp_ranks_split_the_global_batch(blend):
    whole = list(_loader(blend, micro_batch_size=4))
    ranks = [list(_loader(blend, dp_rank=r, dp_size=2)) for r in (0, 1)]
    for k, batch in enumerate(whole):
        for key in batch:
            assert torch.equal(batch[key], torch.cat([ranks[0][k][key], ranks[1][k][key]]))
