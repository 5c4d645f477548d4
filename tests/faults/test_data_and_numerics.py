"""Data, numerics and distributed faults (docs/reliability.md, "Data, numerics, distributed faults").

- data: the shard loader shuffles samples over the whole dataset (documents and windows, seeded
  per epoch), the same global sample at any data-parallel size, every window once per epoch,
  exact resume; a single-shard dataset trains; a truncated shard and out-of-vocab ids fail
  naming the shard;
- numerics: a non-finite loss skips the optimizer step (counted, weights unchanged and finite),
  train.max_skipped_steps in a row stop the run with the last good checkpoint as `latest`;
- distributed: a rank that exits or hangs makes the other fail within
  parallel.distributed_timeout_minutes instead of hanging.
"""

import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from oryx_megatron.data.loader import ShardLoader
from oryx_megatron.data.shards import Manifest, ShardWriter
from tests.data.conftest import dataset, prepare, second_dataset, unique_docs  # noqa: F401 (fixtures)
from tests.data.test_loader import epoch_windows
from tests.distributed import _free_port
from tests.test_train import losses, run_config

SEQ = 32


def _loader(data_path, **kw):
    return ShardLoader(data_path, **{**dict(seq_len=SEQ, micro_batch_size=4, seed=11,
                                            mode_schedule={"name": "all_linear"}), **kw})


def _rows(loader, n):
    out = []
    for _ in range(n):
        b = next(loader)
        out += [tuple(r) for r in torch.cat([b["tokens"], b["labels"][:, -1:]], 1).tolist()]
    return out


def _doc_names(row):
    return set(re.findall(r"(?:doc|other)-\d{5}", "".join(chr(t) for t in row if t < 256)))


# --- data ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    """40 documents in 4 shards of 10; every token of document i is chr(48 + i)."""
    return prepare(tmp_path_factory.mktemp("marked"), [chr(48 + i) * 40 for i in range(40)], 10)


def _neighbours(rows):
    """(pairs of consecutive samples, those sharing a document, those reading the same shards)."""
    docs = [{t - 48 for t in row if t < 256} for row in rows]
    shards = [{d // 10 for d in ds} for ds in docs]
    pairs = list(zip(range(len(rows)), range(1, len(rows))))
    return len(pairs), sum(bool(docs[a] & docs[b]) for a, b in pairs), sum(shards[a] == shards[b] for a, b in pairs)


def test_consecutive_samples_come_from_different_documents_and_shards(marked):
    rows = _rows(_loader(marked.root), 12)  # 48 of the 51 samples of an epoch
    pairs, same_doc, same_shards = _neighbours(rows)
    # the epoch's windows in stream order: 46 of the 47 neighbours share a document
    assert pairs == 47 and _neighbours(epoch_windows(marked, SEQ, 11, 0)[:48])[1] == 46
    assert same_doc <= 4 and same_shards <= 8, (same_doc, same_shards)  # seed 11: 2 and 2


def test_global_sample_is_the_same_at_dp_1_and_dp_2(dataset, second_dataset):
    blend = [0.6, dataset.root, 0.4, second_dataset.root]
    one = _rows(_loader(blend), 8)
    ranks = [_loader(blend, micro_batch_size=2, dp_rank=r, dp_size=2) for r in (0, 1)]
    two = [row for _ in range(8) for rank in ranks for row in _rows(rank, 1)]
    assert two == one


def test_each_epoch_is_a_permutation_of_all_windows(dataset):
    loader, n = _loader(dataset.root, micro_batch_size=3), 51  # (1600 tokens + 40 EOD - 1) // 32 windows
    for epoch in range(3):
        rows = _rows(loader, n // 3)
        windows = epoch_windows(dataset, SEQ, 11, epoch)
        assert len(windows) == len(rows) == n
        assert sorted(rows) == sorted(windows)  # the same multiset: every window exactly once
        assert rows != windows


def test_resume_is_exact_at_another_dp_size(dataset, second_dataset):
    blend = [0.5, dataset.root, 0.5, second_dataset.root]
    straight = _rows(_loader(blend), 10)
    first = _loader(blend, micro_batch_size=2, dp_rank=0, dp_size=2, num_workers=1)
    _rows(first, 3)  # 12 global samples
    state = json.loads(json.dumps(first.state_dict()))
    first.close()
    resumed = _loader(blend)
    resumed.load_state_dict(state)
    assert _rows(resumed, 7) == straight[12:]


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    return prepare(tmp_path_factory.mktemp("one"), unique_docs("doc", 60), 1000)


def test_single_shard_dataset_trains_and_evaluates(one_shard, tmp_path):
    from oryx_megatron.training.loop import pretrain

    assert len(one_shard.shards) == 1
    train = ShardLoader(one_shard.root, seq_len=SEQ, micro_batch_size=1, holdout_shards=1)
    valid = ShardLoader(one_shard.root, seq_len=SEQ, micro_batch_size=1, holdout_shards=1, split="valid")
    assert [s[0] for s in (train.state_dict()["sources"], valid.state_dict()["sources"])] == [[54, 2160], [6, 240]]
    train_names = set().union(*map(_doc_names, _rows(train, 80)))
    valid_names = set().union(*map(_doc_names, _rows(valid, 20)))
    # the last 10% of the documents are held out (names cut by a window boundary are not found)
    assert train_names <= {f"doc-{i:05d}" for i in range(54)} and len(train_names) > 40
    assert valid_names <= {f"doc-{i:05d}" for i in range(54, 60)} and len(valid_names) >= 4
    run = run_config({"shards": str(one_shard.root)}, tmp_path, "train.train_iters=3", "train.eval_interval=3",
                     "train.eval_iters=1", "data.holdout_shards=1")
    assert pretrain(run, str(tmp_path / "out")) == 0
    assert len(losses(tmp_path / "out")) == 3 and len(losses(tmp_path / "out", "eval/loss_all_attention")) == 1


def _copy(manifest, tmp_path):
    shutil.copytree(manifest.root, tmp_path / "copy")
    return tmp_path / "copy"


def test_truncated_shard_is_an_error_naming_it(dataset, tmp_path):
    root = _copy(dataset, tmp_path)
    shard = root / "shard-000002.tar"
    shard.write_bytes(shard.read_bytes()[:1800])  # in the middle of the block's tokens (bytes 1536-2464)
    with pytest.raises(ValueError, match=r"cannot read shard .*shard-000002.tar: member '000000.tokens.npy' ends at "
                                         r"byte 2464, the file has 1800: the shard is truncated"):
        _loader(root)


def test_out_of_vocab_ids_are_an_error_naming_the_shard(dataset, tmp_path):
    root = _copy(dataset, tmp_path)
    writer = ShardWriter(root / "shard-000001.tar", np.uint16)
    for i in range(10):
        writer.add(np.full(40, 300 if i == 3 else 65))  # the byte tokenizer's vocab is 257
    writer.close()
    with pytest.raises(ValueError, match=r"shard .*shard-000001.tar holds token id 300, beyond the manifest's "
                                         r"vocab_size 257"):
        _rows(_loader(root, micro_batch_size=51), 1)  # the whole epoch: every shard is read
    assert Manifest.read(root).vocab_size == 257


# --- numerics ------------------------------------------------------------------------------------

def _trainer(corpus, tmp_path, *overrides):
    from oryx_megatron.parallel import initialize_parallel
    from oryx_megatron.training.loop import Trainer

    run = run_config(corpus, tmp_path, *overrides)
    initialize_parallel(seed=run.train.seed)
    return Trainer(run, str(tmp_path / "out"))


def _nan_at(trainer, iterations):
    """A forward hook that makes the loss NaN during the given (0-based, before the step) iterations."""
    def hook(module, args, output):
        return output * float("nan") if trainer.iteration in iterations else output
    return trainer.model[0].register_forward_hook(hook)


def _params(trainer):
    return [p.detach().clone() for chunk in trainer.model for p in chunk.parameters()]


def test_nan_loss_skips_the_step_counts_it_and_training_continues(corpus, tmp_path):
    from oryx_megatron.compat.cpu import cuda_to_cpu

    with cuda_to_cpu(), _trainer(corpus, tmp_path, "train.train_iters=6", "train.log_interval=3") as trainer:
        trainer.resume()
        trainer.train_step()
        before, lr = _params(trainer), trainer.optimizer.param_groups[0]["lr"]
        hook = _nan_at(trainer, {1})
        loss_sums, grad_norm = trainer.train_step()
        assert grad_norm is None and trainer.iteration == 2
        assert all(torch.equal(a, b) for a, b in zip(before, _params(trainer)))  # no update
        assert trainer.optimizer.param_groups[0]["lr"] == lr  # nor an LR step
        hook.remove()
        hook = _nan_at(trainer, {4})
        assert trainer.train() == 0
        hook.remove()
        assert all(torch.isfinite(p).all() for p in _params(trainer))
        assert not any(torch.equal(a, b) for a, b in zip(before, _params(trainer)) if a.numel() > 1)
    rows = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/skipped_steps" in r]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1]  # iterations 3 and 6; the 5th step was skipped
    assert all(math.isfinite(r["train/loss"]) for r in rows)


def test_max_skipped_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(corpus, tmp_path):
    from oryx_megatron.compat.cpu import cuda_to_cpu
    from oryx_megatron.training.loop import NumericalFault, pretrain

    args = ["train.train_iters=8", "train.max_skipped_steps=2", "checkpoint.save_interval=2"]
    with cuda_to_cpu(), _trainer(corpus, tmp_path, *args) as trainer:
        trainer.resume()
        _nan_at(trainer, set(range(4, 8)))  # steps 5, 6: skipped; at 6 nothing is saved
        with pytest.raises(NumericalFault, match=r"2 optimizer steps in a row skipped .* at iteration 6; stopping "
                                                 r"without saving: the last good checkpoint is .*iter_0000004"):
            trainer.train()
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text().strip() == "iter_0000004"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    resumed = run_config(corpus, tmp_path, "train.train_iters=5")  # the good checkpoint resumes
    assert pretrain(resumed, str(tmp_path / "resumed")) == 0
    assert len(losses(tmp_path / "resumed")) == 1 and all(math.isfinite(x) for x in losses(tmp_path / "resumed"))


# --- distributed ---------------------------------------------------------------------------------

TIMEOUT_S = 3


def _rank(rank, port, fault, result, ready):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), TORCHDYNAMO_DISABLE="1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from oryx_megatron.parallel import initialize_parallel

    ready.wait()  # imports done on both ranks: the rendezvous itself is well within the timeout
    initialize_parallel(timeout_minutes=TIMEOUT_S / 60)

    dist.all_reduce(torch.ones(1))  # both ranks are up
    if rank == 1:
        if fault == "exit":
            os._exit(1)
        time.sleep(120)  # hangs; the parent kills it
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
        Path(result).write_text(json.dumps({"error": None}))
    except Exception as e:  # noqa: BLE001 - what the survivor sees
        Path(result).write_text(json.dumps({"error": f"{type(e).__name__}: {e}", "seconds": time.perf_counter() - start}))


@pytest.mark.parametrize("fault", ["exit", "hang"])
def test_a_dead_or_hung_rank_makes_the_other_fail_within_the_timeout(fault, tmp_path):
    ctx, port, result = mp.get_context("spawn"), _free_port(), tmp_path / "rank0.json"
    ready = ctx.Barrier(2)
    procs = [ctx.Process(target=_rank, args=(r, port, fault, str(result), ready)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        procs[0].join(60)
        assert not procs[0].is_alive(), "rank 0 hangs"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    report = json.loads(result.read_text())
    assert report["error"] and report["seconds"] < TIMEOUT_S + 5, report
    if fault == "hang":
        assert "timed out" in report["error"].lower() or "timeout" in report["error"].lower(), report
