"""Layout equivalence at the level of gradients, through the path a real run takes (``pretrain`` ->
``Trainer.train_step``: megatron's DDP or distributed-optimizer reductions, the per-token loss normalisation,
gradient accumulation over micro-batches, ``train/grad_norm``): each layout's first-step gradients (every
parameter, reduced, before clipping) and every step's logged gradient norm and loss equal the one-process run's.

AdamW normalises each gradient element by its own running scale and clipping rescales the whole gradient, so a
gradient wrong by a constant factor under one layout (a token count left out of a reduction, a contribution
counted twice) barely moves the loss: loss curves alone pass it, these tests do not
(``test_a_gradient_doubled_under_a_layout_is_caught``).

The layouts of 4 processes are marked ``four_ranks``: ``make test-four-ranks`` runs them, ``make test`` does not."""

import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from oryx_megatron.checks.chaos.compare import compare_checkpoints
from oryx_megatron.training import builders
from oryx_megatron.training.loop import pretrain
from tests.distributed import run_distributed
from tests.layout_gradients import norm_errors, pretrain_saving_first_gradients, relative_errors
from tests.test_train import LAYOUT_TOLERANCE, losses, run_config, train_overrides

STEPS = ["train.train_iters=3", "checkpoint.save_at_end=true"]
# Tolerances, fp32 with another order of the same sums (a layout changes nothing else); measured over the
# layouts below, 2026-12-03:
GRAD_TOLERANCE = 1e-6  # ||g - g_ref|| / ||g_ref|| of each parameter: measured at most 4.2e-7 (A_log, TP=2 + SP)
# ... but for Mamba-2's D ([heads]): its gradient, a sum over every token of dy * x, cancels to ~1e-5 of the
# whole gradient's scale, so the same absolute rounding (~2e-10) is a larger relative one: measured 9.5e-6 at CP=4
GRAD_TOLERANCE_OF = {"linear_mixer.D": 5e-5}
NORM_TOLERANCE = 2e-6  # |n - n_ref| / n_ref of each step's train/grad_norm: measured at most 8.0e-7 (TP=2, GDN)
# A doubled gradient gives 1.0 and 1.0 (test_a_gradient_doubled_under_a_layout_is_caught).


def _run(tmp: str, corpus: dict, overrides: list, double_gradients: bool = False) -> None:
    """STEPS iterations, the first step's gradients in <tmp>/grads; ``double_gradients``: megatron's
    finalize_model_grads told half the global token count (a count left out of a reduction)."""
    finalize = builders.finalize_model_grads
    if double_gradients:
        builders.finalize_model_grads = lambda model, num_tokens=None, **kw: finalize(model, num_tokens // 2, **kw)
    try:
        run = run_config(corpus, Path(tmp), *STEPS, *overrides, indexed=True)
        assert pretrain_saving_first_gradients(run, f"{tmp}/out", f"{tmp}/grads") == 0
    finally:
        builders.finalize_model_grads = finalize


def _runs(tmp: str, corpus: dict, cases: list) -> None:
    for name, overrides, double_gradients in cases:
        _run(f"{tmp}/{name}", corpus, overrides, double_gradients)


def family(name: str) -> list:
    return [f"model.family={name}"]


TP2, PP2 = ["parallel.tensor_model_parallel_size=2"], ["parallel.pipeline_model_parallel_size=2"]
CP2, CP4 = ["parallel.context_parallel_size=2"], ["parallel.context_parallel_size=4"]
SP, VP2 = ["parallel.sequence_parallel=true"], ["parallel.virtual_pipeline_model_parallel_size=2"]
DIST_OPT = ["optimizer.use_distributed_optimizer=true"]
# The one-process runs: name -> overrides (tests/test_train.py's tiny model: 2 layers, 4 micro-batches of 2).
REFERENCES = {name: family(name) for name in ("oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer")}
REFERENCES["oryx_tm_4_layers"] = family("oryx_tm") + ["model.num_layers=4"]  # a layer per virtual stage
# every kind of layer, the stages split at '|' (3 + 1 layers) under pipeline parallelism (one process: no split)
REFERENCES["pattern"] = family("oryx_tm") + ["model.num_layers=4", "model.layer_pattern='O*M|G'"]
# A covering set, not every family x every layout: every layout of the issue once (CP=2 twice), every family
# under 3 or 4 layouts, each linear mixer under TP, CP and PP. name -> (processes, reference, overrides).
LAYOUTS = {
    "dp2": (2, "oryx_tm", []),
    "dp2_distributed_optimizer": (2, "oryx_tg", DIST_OPT + ["parallel.overlap_grad_reduce=true"]),
    "tp2": (2, "gdn", TP2),
    "tp2_sp": (2, "oryx_tg", TP2 + SP),
    "pp2": (2, "mamba2", PP2),
    "pp2_vp2": (2, "oryx_tm_4_layers", PP2 + VP2),
    "pp2_pattern_distributed_optimizer": (2, "pattern", PP2 + DIST_OPT),
    "cp2": (2, "oryx_tg", CP2),
    "cp2_transformer": (2, "transformer", CP2),
    "cp4": (4, "oryx_tm", CP4),
    "tp2_sp_cp2": (4, "oryx_tg", TP2 + SP + CP2),
    "dp2_cp2": (4, "gdn", CP2),
    "pp2_dp2_distributed_optimizer": (4, "transformer", PP2 + DIST_OPT),  # the tied embedding across stages
    "accumulation": (1, "oryx_tg", ["train.micro_batch_size=8"]),  # 1 micro-batch of 8 against 4 of 2
    "accumulation_mamba2": (1, "mamba2", ["train.micro_batch_size=8"]),
}
DOUBLED = "cp2_doubled_gradients"  # CP=2 of oryx_tg with half the token count in finalize_model_grads


def layouts_of(processes: int) -> list:
    """(name, overrides, double_gradients) of the LAYOUTS of ``processes`` processes."""
    return [(name, REFERENCES[ref] + layout, False) for name, (n, ref, layout) in LAYOUTS.items() if n == processes]


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory) -> Path:
    """Every one-process reference run, ``<tmp>/<name>/{out,grads,ckpt}``; the layouts' runs go beside them."""
    tmp = tmp_path_factory.mktemp("layout_gradients")
    for name, overrides in REFERENCES.items():
        _run(str(tmp / name), corpus, overrides)
    return tmp


@pytest.fixture(scope="module")
def runs(corpus, references) -> Path:
    """The layouts of 1 process, then those of 2 (and DOUBLED) in one process group, one run after the other."""
    _runs(str(references), corpus, layouts_of(1))
    run_distributed(_runs, str(references), corpus, layouts_of(2) + [(DOUBLED, REFERENCES["oryx_tg"] + CP2, True)])
    return references


@pytest.fixture(scope="module")
def runs_of_four_ranks(corpus, references) -> Path:
    """The layouts of 4 processes, in one process group (``make test-four-ranks``)."""
    run_distributed(_runs, str(references), corpus, layouts_of(4), world_size=4)
    return references


def mismatches(got: Path, want: Path) -> List[str]:
    """What differs between two runs beyond the tolerances: the first step's gradient of each parameter,
    each step's gradient norm and loss."""
    found = []
    for key, error in relative_errors(got / "grads", want / "grads").items():
        tolerance = next((tol for name, tol in GRAD_TOLERANCE_OF.items() if key.endswith(name)), GRAD_TOLERANCE)
        if not error <= tolerance:
            found.append(f"gradient of {key}: relative error {error:.2e} > {tolerance:.0e}")
    norms = norm_errors(losses(got / "out", "train/grad_norm"), losses(want / "out", "train/grad_norm"))
    found += [f"train/grad_norm of step {i + 1}: relative error {e:.2e}" for i, e in enumerate(norms)
              if not e <= NORM_TOLERANCE]
    curve, reference = losses(got / "out"), losses(want / "out")
    assert len(curve) == len(reference) == 3
    found += [f"train/loss of step {i + 1}: {a} vs {b}" for i, (a, b) in enumerate(zip(curve, reference))
              if not abs(a - b) < LAYOUT_TOLERANCE]
    return found


@pytest.mark.parametrize("layout", [pytest.param(name, marks=[pytest.mark.four_ranks] if n == 4 else [])
                                    for name, (n, _, _) in LAYOUTS.items()])
def test_a_layouts_gradients_equal_one_process(layout, request):
    runs = request.getfixturevalue("runs_of_four_ranks" if LAYOUTS[layout][0] == 4 else "runs")
    assert mismatches(runs / layout, runs / LAYOUTS[layout][1]) == []


def test_a_gradient_doubled_under_a_layout_is_caught(runs):
    found = mismatches(runs / DOUBLED, runs / "oryx_tg")
    gradients = [line for line in found if line.startswith("gradient of")]
    assert len(gradients) == len(relative_errors(runs / DOUBLED / "grads", runs / "oryx_tg" / "grads"))  # every one
    assert all("relative error 1.00e+00" in line for line in gradients), gradients
    assert [line for line in found if line.startswith("train/grad_norm")] == [
        f"train/grad_norm of step {i}: relative error 1.00e+00" for i in (1, 2, 3)]
    # and the loss curve alone passes it: clipping to 1.0 turns the doubled gradient into the same update
    assert [line for line in found if line.startswith("train/loss")] == []


def test_a_checkpoint_saved_at_tp2_evaluates_at_tp1_as_the_one_process_run_does(corpus, runs, tmp_path):
    """The TP=2 + SP run's final checkpoint, resumed in one process, gives the reference's eval loss."""
    evaluate = ["train.train_iters=3", "train.eval_interval=3", "train.eval_iters=2",
                "train.eval_schedules=[all_attention]"]
    got = []
    for name in ("tp2_sp", "oryx_tg"):
        run = run_config(corpus, runs / name, *family("oryx_tg"), *evaluate, indexed=True)  # resumes at 3
        assert pretrain(run, str(tmp_path / name)) == 0
        got.append(losses(tmp_path / name, "eval/loss_all_attention"))
    assert len(got[0]) == 1 and abs(got[0][0] - got[1][0]) < LAYOUT_TOLERANCE, got


@pytest.mark.parametrize("layout", ["dp2", "cp2"])
def test_torchrun_trains_as_the_forked_processes_do(corpus, runs, tmp_path, layout):
    """``torchrun --nproc-per-node 2 -m oryx_megatron.cli.train``: real interpreters (their own start, hash seeds,
    import-time output and teardown, which forked ranks skip: tests/processes.py) train what the forked ranks
    of the same config trained: the same losses and gradient norms, the same final checkpoint, bit for bit."""
    overrides = train_overrides(corpus, tmp_path, *STEPS, *REFERENCES[LAYOUTS[layout][1]], *LAYOUTS[layout][2],
                                indexed=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "oryx_megatron.cli.train", *overrides, f"hydra.run.dir={tmp_path / 'out'}"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for key in ("train/loss", "train/grad_norm"):
        assert losses(tmp_path / "out", key) == losses(runs / layout / "out", key), key
    diff = compare_checkpoints(runs / layout / "ckpt/iter_0000003", tmp_path / "ckpt/iter_0000003")
    assert diff["keys_only_in_one"] == [] and diff["tensors_compared"] > diff["model_tensors_compared"] > 0
    assert diff["max_tensor_diff"] == diff["common_state_diff"] == 0.0, diff
