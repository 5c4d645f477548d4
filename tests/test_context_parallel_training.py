"""oryx-train with context parallelism (2 gloo processes): a CP=2 run follows the one-process loss curve, resumes
exactly, and its checkpoints are CP-agnostic (a CP=2 checkpoint resumes at CP=1 and a CP=1 one at CP=2); bad CP
layouts are one line naming the key."""

from pathlib import Path

import numpy as np
import pytest

from oryx_megatron.run_config import ConfigError
from oryx_megatron.training.loop import pretrain
from tests.distributed import run_distributed
from tests.test_train import LAYOUT_TOLERANCE, losses, run_config

CP2 = ["parallel.context_parallel_size=2"]


def _run(tmp: str, corpus: dict, overrides: list, output: str) -> None:
    assert pretrain(run_config(corpus, Path(tmp), *overrides), output) == 0


@pytest.mark.parametrize("family", ["oryx_tg", "transformer"])
def test_a_context_parallel_run_follows_the_one_process_curve(corpus, tmp_path, family):
    common = ["train.train_iters=5", f"model.family={family}", "data.reset_at_eod=true"]
    assert pretrain(run_config(corpus, tmp_path / "ref", *common), str(tmp_path / "ref/out")) == 0
    run_distributed(_run, str(tmp_path / "cp2"), corpus, common + CP2, str(tmp_path / "cp2/out"))
    reference, curve = losses(tmp_path / "ref/out"), losses(tmp_path / "cp2/out")
    assert len(curve) == 5 and np.max(np.abs(np.array(curve) - reference)) < LAYOUT_TOLERANCE, (reference, curve)
    # the per-mode sums are the whole batch's too: attention-mode and linear-mode losses of every token. Each is
    # a mean over about half the tokens, summed in another order: measured up to 2.2e-6 (4.7 ulps near 5.4, torch
    # 2.11), so 8 ulps; a token lost or counted twice moves it by ~1e-3
    for key in ("train/loss_attention", "train/loss_linear"):
        assert np.max(np.abs(np.array(losses(tmp_path / "cp2/out", key)) - losses(tmp_path / "ref/out", key))) \
            < 2 * LAYOUT_TOLERANCE


def test_a_context_parallel_run_resumes_exactly_and_at_another_layout(corpus, tmp_path):
    straight = ["train.train_iters=6"]
    split = ["train.train_iters=6", "train.exit_interval=3", "checkpoint.save_at_end=true"]
    run_distributed(_run, str(tmp_path / "cp2"), corpus, straight + CP2, str(tmp_path / "cp2/out"))
    for part in ("first", "second"):  # 3 iterations at CP=2, stop (saving), resume at CP=2
        run_distributed(_run, str(tmp_path / "cp2split"), corpus, split + CP2, str(tmp_path / f"cp2split/{part}"))
    resumed = losses(tmp_path / "cp2split/first") + losses(tmp_path / "cp2split/second")
    assert resumed == losses(tmp_path / "cp2/out")  # exact, not approximately

    # CP=2's checkpoint at 3 continues at CP=1 (one process) and CP=1's at CP=2: CP-agnostic checkpoints
    assert pretrain(run_config(corpus, tmp_path / "cp1", *straight), str(tmp_path / "cp1/out")) == 0
    assert pretrain(run_config(corpus, tmp_path / "mixed", *split), str(tmp_path / "mixed/first")) == 0  # CP=1
    run_distributed(_run, str(tmp_path / "mixed"), corpus, split + CP2, str(tmp_path / "mixed/second"))  # CP=2
    assert pretrain(run_config(corpus, tmp_path / "cp2split", "train.train_iters=8"),
                    str(tmp_path / "cp2split/third")) == 0  # CP=2's checkpoint at 6, on at CP=1
    mixed = losses(tmp_path / "mixed/first") + losses(tmp_path / "mixed/second")
    assert np.max(np.abs(np.array(mixed) - losses(tmp_path / "cp1/out"))) < LAYOUT_TOLERANCE
    assert len(losses(tmp_path / "cp2split/third")) == 2


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
