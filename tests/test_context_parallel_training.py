"""oryx-train with context parallelism (2 gloo processes): a CP=2 run on packed short documents (EODs inside the
windows, at CP chunk edges too) follows the one-process loss curve, resumes exactly, and its checkpoints are
CP-agnostic (a CP=2 checkpoint resumes at CP=1 and a CP=1 one at CP=2, both on the uninterrupted run's curve); bad
CP layouts are one line naming the key."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from oryx_megatron.ops.chunking import document_starts
from oryx_megatron.run_config import ConfigError
from oryx_megatron.training import steps
from oryx_megatron.training.loop import pretrain
from tests.distributed import run_distributed
from tests.test_train import LAYOUT_TOLERANCE, losses, run_config

CP2 = ["parallel.context_parallel_size=2"]


def _run(tmp: str, corpus: dict, overrides: list, output: str) -> None:
    assert pretrain(run_config(corpus, Path(tmp), *overrides), output) == 0


def count_document_starts(batches: list, chunk: int):
    """(inside a chunk, at a chunk edge) of ``chunk`` tokens: how many documents start (besides at 0) in the windows
    of ``batches``, by whether they start a chunk (a context-parallel rank's share is made of such chunks)."""
    inside = at_edges = 0
    for batch in batches:
        starts = document_starts(batch["document_ids"]).nonzero()[:, 1]
        at_edges += int((starts % chunk == 0).sum())
        inside += int((starts % chunk != 0).sum())
    return inside, at_edges


@pytest.mark.parametrize("family", ["oryx_tg", "transformer"])
def test_a_context_parallel_run_follows_the_one_process_curve(short_documents, tmp_path, family, monkeypatch):
    common = ["train.train_iters=5", f"model.family={family}", "data.reset_at_eod=true"]
    read = []  # the micro-batches the one-process run read (the CP=2 run reads the same; each rank all of them)
    original = steps.get_batch

    def recording(*args):
        read.append(original(*args))
        return read[-1]

    monkeypatch.setattr(steps, "get_batch", recording)
    assert pretrain(run_config(short_documents, tmp_path / "ref", *common), str(tmp_path / "ref/out")) == 0
    # 5 steps of 4 micro-batches of 2 windows of 64 tokens: documents start inside the 16-token chunks of CP=2 and
    # exactly at their edges (after an EOD at a chunk's last position), as many as the documents' lengths and the
    # loader's seeded order give (the `corpus` of whole source files: none in these windows, 1 window in 200)
    assert len(read) == 20 and count_document_starts(read, 64 // 4) == (146, 10)
    run_distributed(_run, str(tmp_path / "cp2"), short_documents, common + CP2, str(tmp_path / "cp2/out"))
    reference, curve = losses(tmp_path / "ref/out"), losses(tmp_path / "cp2/out")
    assert len(curve) == 5 and np.max(np.abs(np.array(curve) - reference)) < LAYOUT_TOLERANCE, (reference, curve)
    # the per-mode sums are the whole batch's too: attention-mode and linear-mode losses of every token. Each is
    # a mean over about half the tokens, summed in another order: measured up to 2.2e-6 on whole source files (4.7
    # ulps near 5.4, torch 2.11), 1.3e-6 on these documents, so 8 ulps; a token lost or counted twice moves it by ~1e-3
    for key in ("train/loss_attention", "train/loss_linear"):
        assert np.max(np.abs(np.array(losses(tmp_path / "cp2/out", key)) - losses(tmp_path / "ref/out", key))) \
            < 2 * LAYOUT_TOLERANCE


def test_a_context_parallel_run_resumes_exactly_and_at_another_layout(corpus, tmp_path):
    straight = ["train.train_iters=6"]
    split = ["train.train_iters=6", "train.exit_interval=3", "checkpoint.save_at_end=true"]
    run_distributed(_run, str(tmp_path / "cp2"), corpus, straight + CP2, str(tmp_path / "cp2/out"))
    run_distributed(_run, str(tmp_path / "cp2split"), corpus, split + CP2, str(tmp_path / "cp2split/first"))
    shutil.copytree(tmp_path / "cp2split/ckpt", tmp_path / "cp2to1/ckpt")  # CP=2's checkpoint at 3, for CP=1
    run_distributed(_run, str(tmp_path / "cp2split"), corpus, split + CP2, str(tmp_path / "cp2split/second"))
    resumed = losses(tmp_path / "cp2split/first") + losses(tmp_path / "cp2split/second")
    assert len(resumed) == 6 and resumed == losses(tmp_path / "cp2/out")  # 3 at CP=2, stop, 3 more: exact

    # CP=2's checkpoint at 3 continues at CP=1 (one process) and CP=1's at CP=2: CP-agnostic checkpoints, both on
    # the uninterrupted run's curve (the weights at 3 are CP=2's, a few fp32 ulps from CP=1's: LAYOUT_TOLERANCE)
    assert pretrain(run_config(corpus, tmp_path / "cp1", *straight), str(tmp_path / "cp1/out")) == 0
    assert pretrain(run_config(corpus, tmp_path / "cp2to1", *split), str(tmp_path / "cp2to1/second")) == 0  # CP=1
    assert pretrain(run_config(corpus, tmp_path / "mixed", *split), str(tmp_path / "mixed/first")) == 0  # CP=1
    run_distributed(_run, str(tmp_path / "mixed"), corpus, split + CP2, str(tmp_path / "mixed/second"))  # CP=2
    uninterrupted = losses(tmp_path / "cp1/out")
    for first, second in (("cp2split/first", "cp2to1/second"), ("mixed/first", "mixed/second")):
        curve = losses(tmp_path / first) + losses(tmp_path / second)
        assert len(curve) == 6 and np.max(np.abs(np.array(curve) - uninterrupted)) < LAYOUT_TOLERANCE, (first, second)


@pytest.mark.parametrize("override,message", [
    ("data.seq_length=62", r"parallel.context_parallel_size': data.seq_length=62 must divide by 2 x 2"),
    ("model.num_attention_heads=3", r"num_attention_heads=3 must divide by tensor x context parallel size 1 x 2"),
])
def test_context_parallel_layouts_that_do_not_fit_are_one_line(corpus, tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_config(corpus, tmp_path, *CP2, override, "model.kv_channels=16")


def test_joint_routing_prices_attention_by_the_whole_sequence(corpus, tmp_path):
    """router=joint at CP=2: the price follows the fraction of every token of the sequence reading attention,
    not of one rank's share (each rank holds half the tokens: chunks r and 3 - r of 4), so it equals CP=1's."""
    joint = ["router=joint", "model.router_hidden=8", "model.router_chunk_size=16", "router.budget=0.2",
             "router.price_lr=0.5", "train.train_iters=3"]
    assert pretrain(run_config(corpus, tmp_path / "cp1", *joint), str(tmp_path / "cp1/out")) == 0
    run_distributed(_run, str(tmp_path / "cp2"), corpus, joint + CP2, str(tmp_path / "cp2/out"))
    prices = [losses(tmp_path / f"{layout}/out", "router/price") for layout in ("cp1", "cp2")]
    assert len(prices[0]) == 3 and prices[0][-1] > 0
    assert np.max(np.abs(np.array(prices[1]) - prices[0])) < LAYOUT_TOLERANCE, prices
