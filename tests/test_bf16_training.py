"""bf16 training on CPU through megatron's mixed-precision optimizers, with the SSM scalars (A_log,
dt_bias, D) as fp32 parameters: the checkpoint holds each parameter's own optimizer state, so a resumed
run continues bit-identically (training/optimizer.py says what megatron gets wrong without it)."""

import pytest
import torch
from hydra import compose, initialize_config_dir

from oryx_megatron import RECIPES_DIR, checkpoint
from oryx_megatron.run_config import load_train_config
from oryx_megatron.training.loop import pretrain
from tests.test_train import losses

RUN = ["model=tiny_oryx_tm", "model.num_layers=2", "data=mqar", "data.seq_length=32", "data.mqar_vocab_size=64",
       "data.mqar_num_pairs=4", "train.train_iters=4", "train.micro_batch_size=2", "train.global_batch_size=2",
       "train.bf16=true", "train.eval_interval=null", "train.log_interval=1", "optimizer.lr=1e-2",
       "optimizer.lr_warmup_iters=1", "logging.wandb_mode=disabled"]


def train(tmp_path, name, *overrides):
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=[*RUN, *overrides]))
    assert pretrain(run, str(tmp_path / name)) == 0
    return losses(tmp_path / name)


def saved_weights(ckpt_dir):
    from oryx_megatron.inference.checkpoint import load_model

    model, _ = load_model(str(ckpt_dir), torch.bfloat16)
    return dict(model.named_parameters())


@pytest.mark.parametrize("distributed", [False, True], ids=["float16_optimizer", "distributed_optimizer"])
def test_bf16_resume_is_exact_with_fp32_ssm_scalars(tmp_path, distributed):
    both = [f"optimizer.use_distributed_optimizer={str(distributed).lower()}", "checkpoint.save_at_end=true"]
    straight = train(tmp_path, "straight", *both, f"checkpoint.dir={tmp_path / 'a'}")
    split = [*both, f"checkpoint.dir={tmp_path / 'b'}"]
    first = train(tmp_path, "first", *split, "train.exit_interval=2")
    second = train(tmp_path, "second", *split)
    assert first + second == straight  # bit-identical: every state went back to its own parameter
    a, b = (saved_weights(checkpoint.latest_checkpoint(str(tmp_path / d))) for d in ("a", "b"))
    scalars = [n for n in a if n.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "D")]
    assert len(scalars) == 2 * 3 and all(a[n].dtype == torch.float32 for n in scalars)
    assert all(torch.equal(a[n], b[n]) for n in a)
