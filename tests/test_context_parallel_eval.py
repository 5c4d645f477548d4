"""Long-context evaluation with context parallelism: held-out perplexity of a checkpoint loaded at CP=2 (2 gloo
processes, every sequence split over them) equals the one-process evaluation, every schedule."""

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from oryx_megatron import RECIPES_DIR
from oryx_megatron.eval.ppl import evaluate_ppl
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.run_config import load_train_config
from oryx_megatron.training.router import save_model
from tests.distributed import run_distributed
from tests.test_train import TINY_MODEL

PPL = dict(num_batches=2, batch_size=2)


def _evaluate_at_cp2(ckpt: str, out: str) -> None:
    model, run = load_model(ckpt, context_parallel_size=2)
    rows = evaluate_ppl(model, run, **PPL)["rows"]
    if torch.distributed.get_rank() == 0:
        Path(out).write_text(json.dumps(rows))


@pytest.mark.parametrize("family", ["oryx_tm", "transformer"])
def test_perplexity_at_cp2_equals_one_process(single_process_parallel, tmp_path, family):
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=[
            *TINY_MODEL, f"model.family={family}", "data=mqar", "data.seq_length=64", "data.mqar_num_pairs=4",
            "data.mode_schedule.chunk_size=16", "data.reset_at_eod=false", f"checkpoint.dir={tmp_path / 'ckpt'}"]))
    torch.manual_seed(0)
    model = build_model(run.model, transformer_config(run.model))
    ckpt = str(save_model(run, model, iteration=1))
    model, run = load_model(ckpt)
    want = {r["schedule"]: r for r in evaluate_ppl(model, run, **PPL)["rows"]}
    run_distributed(_evaluate_at_cp2, ckpt, str(tmp_path / "cp2.json"))
    got = {r["schedule"]: r for r in json.loads((tmp_path / "cp2.json").read_text())}
    assert got.keys() == want.keys() and len(got) == 4
    for name, row in want.items():
        assert abs(got[name]["loss"] - row["loss"]) < 1e-5, name
        assert got[name]["attention_fraction"] == row["attention_fraction"]


def test_oryx_eval_under_torchrun_with_context_parallel(single_process_parallel, tmp_path):
    """``torchrun --nproc-per-node 2 -m oryx_megatron.cli.evaluate CKPT --task mqar --context-parallel 2`` writes the
    accuracies one process writes; a mismatched process count or --router is one line."""
    import subprocess
    import sys

    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=[
            *TINY_MODEL, "model.family=oryx_tg", "data=mqar", "data.seq_length=64", "data.mqar_num_pairs=4",
            "data.mode_schedule.chunk_size=16", f"checkpoint.dir={tmp_path / 'ckpt'}"]))
    torch.manual_seed(1)
    ckpt = str(save_model(run, build_model(run.model, transformer_config(run.model)), iteration=1))
    task = [ckpt, "--task", "mqar", "--num-samples", "8", "--batch-size", "4"]

    def oryx_eval(*args, processes=1):
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"] if processes > 1 \
            else []
        return subprocess.run([sys.executable, *launch, "-m", "oryx_megatron.cli.evaluate", *args],
                              capture_output=True, text=True, timeout=600)

    one = oryx_eval(*task, "--out", str(tmp_path / "one"))
    two = oryx_eval(*task, "--out", str(tmp_path / "two"), "--context-parallel", "2", processes=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    rows = [json.loads((tmp_path / d / "mqar.json").read_text())["rows"] for d in ("one", "two")]
    assert rows[0] == rows[1] and len(rows[0]) == 3
    bad = oryx_eval(*task, "--context-parallel", "2")
    assert bad.returncode == 2 and bad.stderr.splitlines() == [(
        "oryx-eval: error: argument --context-parallel: 2 must be >= 1 and the number of processes launched "
        "(1: torchrun --nproc-per-node 2)")]  # a real interpreter: nothing printed before it
