"""router=posthoc (training/router.py): the targets are the per-chunk loss differences of two separate
forwards, training changes the router and nothing else, the checkpoint carries it calibrated, and
oryx-generate runs a router budget schedule on it end to end."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oryx_megatron.config import Mode
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.parallel import destroy_parallel
from oryx_megatron.train import pretrain
from oryx_megatron.training.router import chunk_means, router_targets
from tests.test_train import run_config

CHUNK = 16


def test_chunk_means_by_hand():
    values = torch.arange(10, dtype=torch.float64)[None]  # one sample of 10, chunks of 4
    mask = torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1, 0, 0]], dtype=torch.float64)
    means, count = chunk_means(values, mask, 4)
    assert count.tolist() == [[3, 4, 0]] and means.tolist() == [[(0 + 1 + 3) / 3, (4 + 5 + 6 + 7) / 4, 0]]


@pytest.fixture(scope="module")
def posthoc(corpus, tiny_checkpoint, tmp_path_factory):
    """A post-hoc router fitted to the tiny trained Oryx-TG (frozen), 12 iterations."""
    tmp = tmp_path_factory.mktemp("posthoc")
    run = run_config(corpus, tmp, "router=posthoc", f"router.init_from={tiny_checkpoint}", "model.router_hidden=16",
                     f"model.router_chunk_size={CHUNK}", "train.train_iters=12", "train.log_interval=4",
                     "optimizer.lr=3e-2", "router.calibration_batches=2")
    assert pretrain(run, str(tmp / "out")) == 0
    destroy_parallel()
    return run, tmp


def test_targets_are_the_chunk_loss_differences_of_two_forwards(posthoc, tiny_checkpoint):
    run, _ = posthoc
    model, _ = load_model(tiny_checkpoint)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 257, (2, 49), generator=g)
    batch = {"tokens": ids[:, :-1], "labels": ids[:, 1:], "loss_mask": torch.ones(2, 48)}
    benefit, count, _ = router_targets(model, batch, CHUNK)
    with torch.no_grad():
        per_mode = [model(batch["tokens"], torch.full((2, 48), mode, dtype=torch.int8), labels=batch["labels"])
                    for mode in (Mode.LINEAR, Mode.ATTENTION)]
    by_hand = torch.stack([(per_mode[0] - per_mode[1])[:, c * CHUNK : (c + 1) * CHUNK].mean(1) for c in range(3)], 1)
    assert (benefit - by_hand).abs().max() < 1e-6 and count.tolist() == [[CHUNK] * 3] * 2
    destroy_parallel()


def test_posthoc_training_changes_the_router_only_and_calibrates_it(posthoc, tiny_checkpoint):
    run, tmp = posthoc
    rows = [json.loads(line) for line in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "router/loss" in r]
    assert [r["iteration"] for r in logged] == [4, 8, 12]
    assert logged[-1]["router/loss"] < logged[0]["router/loss"]
    for r in logged:
        assert 0 <= r["router/attention_fraction"] <= 1 and 0 <= r["router/target_fraction"] <= 1
        assert r["router/loss_routed"] > 0
    trained, _ = load_model(str(tmp / "ckpt"))
    base, _ = load_model(tiny_checkpoint)
    base_weights = dict(base.named_parameters())
    for name, p in trained.named_parameters():
        if not name.startswith("router."):
            assert torch.equal(p, base_weights[name]), name  # frozen
    assert trained.router.fc2.weight.abs().sum() > 0  # was zero at initialisation
    calibration = trained.router.calibration
    assert not calibration.isnan().any() and (calibration[1:] >= calibration[:-1]).all()
    destroy_parallel()


def test_oryx_generate_runs_a_router_budget_schedule(posthoc):
    _, tmp = posthoc
    out = subprocess.run([sys.executable, "-m", "oryx_megatron.tools.generate", str(tmp / "ckpt"), "--prompt",
                          "def main(" * 3, "--max-new-tokens", "36", "--schedule", "router budget=0.25"],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "schedule: router budget=0.25" in out.stdout
    fraction = float(next(line for line in out.stdout.splitlines() if line.startswith("attention-token fraction"))
                     .split()[-1])
    assert 0 <= fraction <= 0.25 + CHUNK / (27 + 35)  # the budget + one chunk of the 62 tokens fed
