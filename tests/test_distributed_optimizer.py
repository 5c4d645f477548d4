"""The distributed optimizer's checkpoints (megatron's fully_reshardable format, docs/training.md): a run
stopped and resumed equals the uninterrupted run exactly (losses, weights, optimizer state) at DP=2, PP=2
and TP=2 x DP=2; a DP=2 checkpoint continues at DP=1 and at TP=2 as the DP=2 run does; an optimizer
state that this run's optimizer does not load is one line."""

import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from oryx_megatron.checks.chaos.compare import compare_checkpoints
from oryx_megatron.run_config import ConfigError
from oryx_megatron.training import checkpointing
from oryx_megatron.training.loop import pretrain
from tests.distributed import run_distributed
from tests.test_train import _layout_run, losses, run_config

ITERS = 4  # stopped at 2, resumed for 2: the first resumed step's update shows in the loss at 4
DIST_OPT = ["optimizer.use_distributed_optimizer=true", "checkpoint.save_at_end=true"]
RUN = [*DIST_OPT, f"train.train_iters={ITERS}"]
TP2 = ["parallel.tensor_model_parallel_size=2"]
PP2 = ["parallel.pipeline_model_parallel_size=2"]  # the embedding's own grad bucket: megatron's misplaced save
LAYOUTS = {2: {"dp2": [], "pp2": PP2}, 4: {"tp2_dp2": TP2}}  # by process count: name -> overrides
RESHARDS = {"dp1": (1, []), "tp2": (2, TP2)}  # dp2's checkpoint at iteration 2 continued at: (processes, overrides)
FINAL = f"ckpt/iter_{ITERS:07d}"


def _resume_runs(tmp: str, corpus: dict) -> None:
    """In this process group, at each layout of its size: the run uninterrupted (<layout>/straight/), and
    stopped at iteration 2 and resumed (<layout>/split/); after dp2's stop, copies of its checkpoint for
    each of RESHARDS (<reshard>/), and those of this group's size continued here."""
    for name, layout in LAYOUTS[dist.get_world_size()].items():
        _layout_run(f"{tmp}/{name}/straight", corpus, RUN + layout)
        _layout_run(f"{tmp}/{name}/split", corpus, RUN + layout + ["train.exit_interval=2"])
        if name == "dp2" and dist.get_rank() == 0:
            for reshard in RESHARDS:
                shutil.copytree(f"{tmp}/dp2/split/ckpt", f"{tmp}/{reshard}/ckpt")
        dist.barrier()
        _layout_run(f"{tmp}/{name}/split", corpus, RUN + layout)
    for reshard, (processes, overrides) in RESHARDS.items():
        if processes == dist.get_world_size():
            _layout_run(f"{tmp}/{reshard}", corpus, RUN + overrides)


@pytest.fixture(scope="module")
def two_processes(corpus, tmp_path_factory):
    """``_resume_runs`` of 2 processes, then the reshards of 1 process (here)."""
    tmp = tmp_path_factory.mktemp("dist_opt_2")
    run_distributed(_resume_runs, str(tmp), corpus)
    for reshard, (processes, overrides) in RESHARDS.items():
        if processes == 1:
            _layout_run(str(tmp / reshard), corpus, RUN + overrides)
    return tmp


@pytest.fixture(scope="module")
def four_processes(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist_opt_4")
    run_distributed(_resume_runs, str(tmp), corpus, world_size=4)
    return tmp


@pytest.mark.parametrize("processes,layout", [pytest.param(n, name, marks=[pytest.mark.four_ranks] if n == 4 else [])
                                              for n, names in LAYOUTS.items() for name in names])
def test_resume_is_exact(processes, layout, request):
    tmp = request.getfixturevalue({2: "two_processes", 4: "four_processes"}[processes]) / layout
    assert len(losses(tmp / "straight/out")) == ITERS
    assert losses(tmp / "split/out") == losses(tmp / "straight/out")  # exact, not approximately
    diff = compare_checkpoints(tmp / "straight" / FINAL, tmp / "split" / FINAL)
    assert diff["keys_only_in_one"] == [] and diff["common_keys_only_in_one"] == []
    assert diff["tensors_compared"] > 2 * diff["model_tensors_compared"]  # + the main params and both moments
    assert diff["max_weight_diff"] == diff["max_tensor_diff"] == diff["common_state_diff"] == 0.0, diff


@pytest.mark.parametrize("target", list(RESHARDS))
def test_a_dp2_checkpoint_continues_at_another_layout(two_processes, target):
    reference, got = losses(two_processes / "dp2/straight/out"), losses(two_processes / target / "out")
    assert len(got) == ITERS - 2
    assert max(abs(a - b) for a, b in zip(got, reference[2:])) < 1e-5, (got, reference)  # reduction order only
    diff = compare_checkpoints(two_processes / "dp2/straight" / FINAL, two_processes / target / FINAL)
    assert all(key.startswith("rng_state/") for key in diff["keys_only_in_one"])  # kept per layout
    assert diff["max_weight_diff"] < 1e-5 and diff["max_tensor_diff"] < 1e-5, diff  # weights, main params, moments


def _resume_copy(corpus, tmp: Path, ckpt: Path, *overrides):
    """Resume a copy of the checkpoint dir ``ckpt`` in this process (DP=1)."""
    shutil.copytree(ckpt, tmp / "ckpt")
    return pretrain(run_config(corpus, tmp, f"train.train_iters={ITERS}", *overrides, indexed=True), str(tmp / "out"))


def test_the_other_optimizer_kind_is_one_line(corpus, two_processes, tmp_path):
    with pytest.raises(ConfigError) as error:
        _resume_copy(corpus, tmp_path, two_processes / "dp2/straight/ckpt")
    assert str(error.value) == (
        f"config key 'optimizer.use_distributed_optimizer': false, but checkpoint {tmp_path / FINAL} holds the "
        "distributed optimizer's state ('fully_reshardable'): resume it with true")
    run = run_config(corpus, tmp_path / "plain", "train.train_iters=2", "checkpoint.save_at_end=true", indexed=True)
    assert pretrain(run, str(tmp_path / "plain/out")) == 0
    with pytest.raises(ConfigError) as error:
        _resume_copy(corpus, tmp_path / "to_dist", tmp_path / "plain/ckpt", *DIST_OPT)
    assert str(error.value) == (
        f"config key 'optimizer.use_distributed_optimizer': true, but checkpoint "
        f"{tmp_path / 'to_dist/ckpt/iter_0000002'} holds a non-distributed optimizer's state: resume it with false")


def test_another_distributed_optimizer_format_is_one_line(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(checkpointing.OPTIMIZER_METADATA, "distrib_optim_sharding_type", "dp_reshardable")
    run = run_config(corpus, tmp_path / "saved", *DIST_OPT, "train.train_iters=1", indexed=True)
    assert pretrain(run, str(tmp_path / "saved/out")) == 0
    monkeypatch.undo()
    with pytest.raises(ConfigError) as error:
        _resume_copy(corpus, tmp_path / "resumed", tmp_path / "saved/ckpt", *DIST_OPT)
    assert str(error.value) == (
        f"checkpoint {tmp_path / 'resumed/ckpt/iter_0000001'}: the distributed optimizer's state is in megatron's "
        "'dp_reshardable' format (saved at PP=1 TP=1 DP=1); oryx-train loads only 'fully_reshardable', at any "
        "layout (this run: PP=1 TP=1 DP=1)")
