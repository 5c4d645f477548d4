"""oryx-train on CPU: learning, parallel layouts, exact resume, resharding, preemption, config errors."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from oryx_megatron import RECIPES_DIR
from oryx_megatron.launch import REQUEUE_EXIT_CODE
from oryx_megatron.run_config import ConfigError, load_train_config
from oryx_megatron.training.loop import pretrain
from tests.distributed import run_distributed

TINY_MODEL = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.kv_channels=16",
    "model.ffn_hidden_size=128", "model.vocab_size=257", "model.max_sequence_length=64",
    "model.linear_chunk_size=16",
]
TINY_TRAIN = [
    "data.seq_length=64", "data.mode_schedule.chunk_size=16", "train.micro_batch_size=2",
    "train.global_batch_size=8", "train.log_interval=1", "train.eval_interval=null",
    "optimizer.lr_warmup_iters=2", "logging.wandb_mode=disabled", "checkpoint.save_at_end=false",
]


def train_overrides(corpus, tmp_path, *overrides, indexed=False) -> list:
    """The command-line overrides of a tiny run on ``corpus`` checkpointing to ``tmp_path``/ckpt."""
    data = (["data.format=indexed", f"data.data_path=[{corpus['indexed']}]", "data.eod_id=256",
             "data.split='85,15,0'"] if indexed
            else [f"data.data_path=[{corpus['shards']}]"])
    return [*TINY_MODEL, *TINY_TRAIN, *data, f"checkpoint.dir={tmp_path / 'ckpt'}", *overrides]


def run_config(corpus, tmp_path, *overrides, indexed=False):
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        cfg = compose("train", overrides=train_overrides(corpus, tmp_path, *overrides, indexed=indexed))
    return load_train_config(cfg)


def losses(output_dir, key="train/loss"):
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm"])
def test_tiny_model_learns(corpus, tmp_path, family):
    run = run_config(corpus, tmp_path, f"model.family={family}", "train.train_iters=40", "optimizer.lr=1e-2")
    assert pretrain(run, str(tmp_path / "out")) == 0
    curve = losses(tmp_path / "out")
    assert len(curve) == 40
    assert curve[0] > 5.0  # ~ln(257) at initialisation
    assert np.mean(curve[-5:]) < 0.65 * curve[0]  # code bytes are easy to model
    per_mode = losses(tmp_path / "out", "train/loss_attention"), losses(tmp_path / "out", "train/loss_linear")
    assert all(len(c) == 40 for c in per_mode)
    fractions = losses(tmp_path / "out", "train/attention_fraction")
    assert 0.2 < np.mean(fractions) < 0.8  # p_attention = 0.5 over chunks of 16


def _layout_run(tmp: str, corpus: dict, overrides: list):
    run = run_config(corpus, Path(tmp), *overrides, indexed=True)
    assert pretrain(run, f"{tmp}/out") == 0


LAYOUT_TOLERANCE = 2e-6  # 4 fp32 ulps of the loss: a layout changes the order of fp32 sums, nothing else
# (the layouts themselves, at the level of gradients: tests/test_layout_gradients.py)
def test_resume_continues_exactly(corpus, tmp_path):
    straight = run_config(corpus, tmp_path / "straight", "train.train_iters=8")
    assert pretrain(straight, str(tmp_path / "straight_out")) == 0
    for part in ("first", "second"):  # 4 iterations, stop (saving), resume, 4 more
        run = run_config(corpus, tmp_path / "split", "train.train_iters=8", "train.exit_interval=4",
                         "checkpoint.save_at_end=true")
        assert pretrain(run, str(tmp_path / f"{part}_out")) == 0
    assert (tmp_path / "split/ckpt/latest").read_text().strip() == "iter_0000008"
    resumed = losses(tmp_path / "first_out") + losses(tmp_path / "second_out")
    assert resumed == losses(tmp_path / "straight_out")  # exact, not approximately


def test_sigterm_saves_a_checkpoint_and_asks_for_requeue(corpus, tmp_path):
    args = [sys.executable, "-m", "oryx_megatron.cli.train", *TINY_MODEL, *TINY_TRAIN,
            f"data.data_path=[{corpus['shards']}]", "train.train_iters=400", "model.num_layers=1",
            f"checkpoint.dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path / 'run1'}"]
    env = {**os.environ, "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run1" / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.stdout.read()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == REQUEUE_EXIT_CODE, out
    assert "SIGTERM received: saving and exiting for requeue" in out
    saved = (tmp_path / "ckpt" / "latest").read_text().strip()
    stopped_at = int(saved.split("_")[1])
    assert 2 <= stopped_at < 400 and (tmp_path / "ckpt" / saved / "run_config.yaml").exists()

    # the requeued job resumes from that checkpoint and finishes
    args = [a for a in args if not a.startswith(("train.train_iters", "hydra.run.dir"))]
    args += [f"train.train_iters={stopped_at + 2}", f"hydra.run.dir={tmp_path / 'run2'}"]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"resumed from {tmp_path / 'ckpt' / saved} at iteration {stopped_at}" in out.stdout + out.stderr
    assert [row for row in losses(tmp_path / "run2")] and len(losses(tmp_path / "run2")) == 2


@pytest.mark.parametrize(
    "override,message",
    [
        ("+train.micro_batch_sise=4", "micro_batch_sise"),
        ("optimizer.lr_decay_style=cosin", "optimizer.lr_decay_style"),
        ("train.global_batch_size=abc", "train.global_batch_size"),
        ("train.global_batch_size=7", "train.global_batch_size"),
        ("data.seq_length=4096", "data.seq_length"),
        ("parallel.virtual_pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size"),
    ],
)
def test_config_errors_name_the_key(corpus, tmp_path, override, message):
    # keys and types are checked as Hydra composes onto the schema, values by load_train_config
    with pytest.raises((ConfigCompositionException, ConfigError), match=message.replace(".", r"\.")):
        run_config(corpus, tmp_path, override)


def test_cli_misspelled_key_fails_before_training_in_one_line(tmp_path):
    """A real interpreter (not a fork of the suite's, tests/processes.py): what it prints as it starts counts too."""
    out = subprocess.run([sys.executable, "-m", "oryx_megatron.cli.train", "train.micro_batch_sise=4",
                          f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [
        "oryx-train: error: Could not override 'train.micro_batch_sise': Key 'micro_batch_sise' not in 'TrainingConfig'"]
    assert not (tmp_path / "metrics.jsonl").exists()


def test_multirun_sweep_runs_one_job_per_point_through_submitit(corpus, tmp_path):
    """`oryx-train -m ... hydra/launcher=local`: the submitit launcher SLURM sweeps use, executed locally."""
    args = [sys.executable, "-m", "oryx_megatron.cli.train", "-m", "hydra/launcher=local", *TINY_MODEL, *TINY_TRAIN,
            f"data.data_path=[{corpus['shards']}]", "train.train_iters=2", "model.num_layers=1",
            "optimizer.lr=1e-3,3e-3", "checkpoint.dir=null", f"hydra.sweep.dir={tmp_path}"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TORCHDYNAMO_DISABLE": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    points = [OmegaConf.load(tmp_path / job / ".hydra" / "overrides.yaml") for job in ("0", "1")]
    assert [[o for o in p if o.startswith("optimizer.lr=")] for p in points] == [["optimizer.lr=0.001"], ["optimizer.lr=0.003"]]
    lr = [losses(tmp_path / job, "train/lr") for job in ("0", "1")]  # after the 1-step warmup: the peak lr
    assert len(lr[0]) == len(lr[1]) == 2 and lr[0][0] == pytest.approx(1e-3) and lr[1][0] == pytest.approx(3e-3)


def test_get_batch_moves_every_tensor_to_the_device():
    from oryx_megatron.training.steps import get_batch

    batch = {"tokens": torch.zeros(2, 8, dtype=torch.long), "modes": torch.ones(2, 8, dtype=torch.int8)}
    moved = get_batch(iter([batch]), torch.device("meta"))
    assert {k: (t.device.type, t.dtype, tuple(t.shape)) for k, t in moved.items()} == {
        "tokens": ("meta", torch.long, (2, 8)), "modes": ("meta", torch.int8, (2, 8))}
    same = get_batch(iter([batch]), torch.device("cpu"))
    assert all(same[k] is batch[k] for k in batch)  # on the CPU nothing is copied


def test_eval_loaders_are_built_once_rewound_and_closed(corpus, tmp_path):
    import psutil

    from oryx_megatron.compat.cpu import cuda_to_cpu
    from oryx_megatron.parallel import initialize_parallel
    from oryx_megatron.training.loop import Trainer

    run = run_config(corpus, tmp_path, "train.train_iters=2", "train.eval_interval=1", "train.eval_iters=2",
                     "data.num_workers=1", "train.eval_schedules=[all_attention,all_linear]")
    initialize_parallel(seed=run.train.seed)
    others = set(psutil.Process().children(recursive=True))  # of earlier tests (e.g. W&B's service)
    with cuda_to_cpu(), Trainer(run, str(tmp_path / "out")) as trainer:
        trainer.train_step()
        first = trainer.evaluate()
        workers = [p for p in psutil.Process().children(recursive=True) if p not in others]
        assert trainer.evaluate() == first  # the same windows again: the loaders were rewound
        assert [p for p in psutil.Process().children(recursive=True) if p not in others] == workers  # no new pools
        assert set(first) == {"eval/loss_all_attention", "eval/loss_all_linear"}
        assert len(workers) == 3  # one worker each: the train loader's pool and one pool per eval schedule
    assert not [w for w in workers if w.is_running() and w.status() != psutil.STATUS_ZOMBIE]


def test_a_trainer_that_fails_to_build_closes_what_it_opened(corpus, tmp_path, monkeypatch):
    import oryx_megatron.training.loop as train_module
    from oryx_megatron.compat.cpu import cuda_to_cpu
    from oryx_megatron.parallel import initialize_parallel

    pools = []  # the worker pool of every loader the Trainer builds

    def recording_build_loader(*args, **kwargs):
        loader = build_loader(*args, **kwargs)
        pools.append(loader._pool)
        return loader

    def broken_metrics(*args, **kwargs):
        raise RuntimeError("metrics backend down")

    build_loader = train_module.build_loader
    monkeypatch.setattr(train_module, "build_loader", recording_build_loader)
    monkeypatch.setattr(train_module, "MetricsLogger", broken_metrics)  # fails after the loaders are open
    run = run_config(corpus, tmp_path, "train.train_iters=2", "train.eval_interval=1", "data.num_workers=1")
    initialize_parallel(seed=run.train.seed)
    with cuda_to_cpu(), pytest.raises(RuntimeError, match="metrics backend down"):
        train_module.Trainer(run, str(tmp_path / "out"))
    assert len(pools) == 3  # train, and one per eval schedule
    for pool in pools:  # every one was shut down
        with pytest.raises(RuntimeError, match="after shutdown"):
            pool.submit(int)
