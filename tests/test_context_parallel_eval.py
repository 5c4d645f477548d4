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
