"""Asynchronous checkpoint saves (``checkpoint.async_save``; issue #30, item 4): training goes on while the
shards are written, the run and its checkpoints are the sync run's bit for bit, `latest` moves only once the
writers of EVERY rank have finished, and each save logs the time it blocked the loop. Kills inside the
background writes: tests/faults/test_chaos.py."""

import json
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from oryx_megatron.checkpoint import CHECKSUMS, latest_name, verify_checkpoint
from oryx_megatron.checks.chaos.compare import compare_checkpoints
from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.parallel import initialize_parallel
from oryx_megatron.training import saving
from oryx_megatron.training.loop import Trainer, pretrain
from tests.distributed import run_distributed
from tests.test_train import losses, run_config

RUN = ["model.num_layers=1", "train.train_iters=6", "checkpoint.save_interval=2"]
SAVED = (2, 4, 6)


def metric_rows(output_dir: Path, key: str):
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if key in row]


@pytest.fixture(scope="module")
def sync_and_async(corpus, tmp_path_factory):
    """The same 6 iterations saved every 2, synchronously (sync/) and asynchronously (async/)."""
    tmp = tmp_path_factory.mktemp("saves")
    for mode in ("sync", "async"):
        run = run_config(corpus, tmp / mode, *RUN, f"checkpoint.async_save={str(mode == 'async').lower()}")
        assert pretrain(run, str(tmp / mode / "out")) == 0
    return tmp


def test_async_saves_train_and_save_what_sync_saves_do(sync_and_async):
    sync, async_ = sync_and_async / "sync", sync_and_async / "async"
    assert len(losses(async_ / "out")) == 6 and losses(async_ / "out") == losses(sync / "out")
    assert latest_name(str(async_ / "ckpt")).name == "iter_0000006"
    for iteration in SAVED:
        name = f"ckpt/iter_{iteration:07d}"
        verify_checkpoint(async_ / name)  # with its checksums
        diff = compare_checkpoints(sync / name, async_ / name)
        assert diff["tensors_compared"] > 0 and diff["keys_only_in_one"] == []
        assert diff["max_tensor_diff"] == 0.0 and diff["common_state_diff"] == 0.0, diff
        assert diff["checksums_match"]


def test_each_save_logs_the_time_it_blocked_the_loop(sync_and_async):
    sync, async_ = sync_and_async / "sync/out", sync_and_async / "async/out"
    for out in (sync, async_):
        assert [row["iteration"] for row in metric_rows(out, "checkpoint/blocking_s")] == list(SAVED)
    assert metric_rows(sync, "checkpoint/background_s") == []
    completed = metric_rows(async_, "checkpoint/background_s")  # one per save, when it completes
    assert len(completed) == len(SAVED) and all(row["checkpoint/finalize_s"] >= 0 for row in completed)
    assert all(row["iteration"] >= saved for row, saved in zip(completed, SAVED))


GATE = "rank1_may_write"


def _gated(write_and_hash):
    """Rank 1's writer waits for the gate file beside the checkpoints before it writes."""

    def gated(self, rank, *args, **kwargs):
        gate = Path(args[0][0][0]).parents[1] / GATE  # the first file of its write buckets: ckpt/iter_N/file
        deadline = time.monotonic() + 300
        while rank == 1 and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return write_and_hash(self, rank, *args, **kwargs)

    return gated


def _two_ranks_one_writer_held(tmp: str, corpus: dict) -> None:
    """DP=2, async saves every 2 of 6 iterations; rank 1's writer is held until the end of step 4. Rank 0
    records, after each step (before the step's poll): the iteration, what `latest` names and whether its own
    writers have ended, which it waits for at step 3."""
    saving._HashingWriter.__call__ = _gated(saving._HashingWriter.__call__)  # this process and its writers
    run = run_config(corpus, Path(tmp), *RUN, "checkpoint.async_save=true")
    initialize_parallel(seed=run.train.seed)
    seen = []
    with cuda_to_cpu(), Trainer(run, f"{tmp}/out") as trainer:
        trainer.resume()
        step = trainer.train_step

        def observed_step():
            result = step()
            if dist.get_rank() == 0:
                callers = [call.async_caller for call in trainer.saver.queue.async_calls]
                if trainer.iteration == 3:  # rank 0's writer of iteration 2 ends before the poll after step 3
                    for caller in callers:
                        caller.process.join(timeout=120)
                writing = any(c.process is not None and c.process.is_alive() for c in callers)
                latest = latest_name(trainer.ckpt_dir)
                seen.append([trainer.iteration, latest and latest.name, not writing])
                if trainer.iteration == 4:
                    (Path(trainer.ckpt_dir) / GATE).touch()
            return result

        trainer.train_step = observed_step
        assert trainer.train() == 0
    if dist.get_rank() == 0:
        Path(tmp, "seen.json").write_text(json.dumps(seen))


def test_latest_moves_only_once_every_rank_has_written(corpus, tmp_path):
    run_distributed(_two_ranks_one_writer_held, str(tmp_path), corpus)
    seen = {iteration: (latest, own_writer_done) for iteration, latest, own_writer_done in
            json.loads((tmp_path / "seen.json").read_text())}
    # steps 3 and 4 ran while rank 1 had not written iteration 2; rank 0 had, before the poll after step 3
    assert seen[3] == (None, True) and seen[4] == (None, True), seen
    assert seen[5][0] in ("iter_0000002", "iter_0000004") and seen[6][0] is not None, seen
    assert latest_name(str(tmp_path / "ckpt")).name == "iter_0000006"
    for iteration in SAVED:
        ckpt = tmp_path / f"ckpt/iter_{iteration:07d}"
        verify_checkpoint(ckpt)
        assert any(line.endswith("__1_0.distcp") for line in (ckpt / CHECKSUMS).read_text().splitlines())
