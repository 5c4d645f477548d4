"""slurm/README.md's commands on a node without GPUs, as written: a paper-scale recipe through train.sbatch
(platform=cpu) and a sweep through the submitit launcher (hydra/launcher=slurm_cpu)."""

import json
import subprocess

import pytest

from tests.slurm.jobs import ENV, REPO, losses, sbatch


def test_paper_scale_recipe_on_the_cpu_node(corpus, tmp_path):
    job = sbatch(tmp_path, "recipe=oryx_tg_130m", "platform=cpu", "train.train_iters=2", "train.train_tokens=null",
                 "train.log_interval=1", f"data.data_path=[{corpus['shards']}]", "logging.wandb_mode=disabled",
                 f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.save_at_end=false",
                 f"hydra.run.dir={tmp_path / 'run'}")
    info = job.done(900)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), job.log
    assert "--nproc-per-node=1 " in job.log
    assert "oryx_tg: 1" in job.log and "parameters on this rank, 2 iterations of 512 tokens" in job.log
    assert sorted(losses(tmp_path / "run")) == [1, 2]


def test_sweep_through_submitit_on_the_cpu_node(corpus, tmp_path):
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        ["oryx-train", "-m", "optimizer.min_lr=1e-4,2e-4", "hydra/launcher=slurm_cpu", "hydra.launcher.timeout_min=10",
         f"hydra.sweep.dir={sweep}", "model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
         "model.kv_channels=16", "model.ffn_hidden_size=128", "model.vocab_size=257", "data.seq_length=64",
         "model.max_sequence_length=64", "train.train_iters=2", "train.global_batch_size=2",
         "train.micro_batch_size=2", "train.eval_interval=null", f"data.data_path=[{corpus['shards']}]",
         "logging.wandb_mode=disabled", "checkpoint.save_at_end=false"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # each point trained with its own value: 2 iterations end the schedule at min_lr
    last = [json.loads((sweep / job / "metrics.jsonl").read_text().splitlines()[-1]) for job in ("0", "1")]
    assert [(row["iteration"], row["train/lr"]) for row in last] == [(2, pytest.approx(1e-4)), (2, pytest.approx(2e-4))]
