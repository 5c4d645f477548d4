"""Checkpoints written before MultiMixer's keys were renamed (``linear_in``/``linear_out`` ->
``in_proj``/``out_proj``; ``A_log``, ``dt_bias``, ``D`` -> ``linear_mixer.*``) still load: for
inference, with the weights and logits of the same checkpoint in today's spelling, and to resume
training exactly. A checkpoint holding keys the model does not have, that no migration of
``RENAMED_KEYS`` maps to its own, is refused in one line naming them."""

import shutil
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensor
from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

from oryx_megatron.checkpoint import RUN_CONFIG, CheckpointKeysError
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.training.loop import pretrain
from tests.test_train import losses, run_config

OLD_SPELLING = ((".in_proj.", ".linear_in."), (".out_proj.", ".linear_out."), (".linear_mixer.", "."))


def old_spelling(key: str) -> str:
    for new, old in OLD_SPELLING:
        key = key.replace(new, old)
    return key


def saving_both_spellings(save):
    """dist_checkpointing.save that writes the checkpoint in today's spelling to <path>_new, then
    in the old spelling to <path> (the one `latest` points to)."""

    def save_twice(state, path, *args, **kwargs):
        new = f"{path}_new"
        shutil.copytree(path, new)  # (empty: the run config is written after the save; the test copies it)
        request = save(state, new, *args, **kwargs)
        if request is not None:  # the asynchronous form (training.saving): written here
            request.execute_sync()
        for entry in nested_values(state):
            if isinstance(entry, ShardedBase):
                entry.key = old_spelling(entry.key)
        return save(state, path, *args, **kwargs)

    return save_twice


@pytest.mark.parametrize("family", ["oryx_tg", "oryx_tm"])
def test_a_checkpoint_with_the_old_keys_loads_and_resumes_exactly(corpus, tmp_path, monkeypatch, family):
    model = f"model.family={family}"
    straight = run_config(corpus, tmp_path / "straight", model, "train.train_iters=4")
    assert pretrain(straight, str(tmp_path / "straight_out")) == 0
    split = [model, "train.train_iters=4", "train.exit_interval=2", "checkpoint.save_at_end=true"]
    with monkeypatch.context() as patch:
        patch.setattr(dist_checkpointing, "save", saving_both_spellings(dist_checkpointing.save))
        assert pretrain(run_config(corpus, tmp_path / "split", *split), str(tmp_path / "first_out")) == 0

    old = tmp_path / "split/ckpt/iter_0000002"
    shutil.copy(old / RUN_CONFIG, old.parent / f"{old.name}_new" / RUN_CONFIG)
    keys = {entry.key for entry in load_sharded_metadata(str(old)).values()}
    assert {"decoder.layers.0.mixer.linear_in.weight", "decoder.layers.1.mixer.A_log",
            "optimizer.state.exp_avg.decoder.layers.0.mixer.linear_out.weight"} <= keys
    assert not [k for k in keys if "in_proj" in k or "out_proj" in k or "linear_mixer" in k]
    assert (old.parent / f"{old.name}_new" / RUN_CONFIG).exists()

    # inference: the old spelling loads the weights and logits of today's
    loaded, run = load_model(str(old))
    expected, _ = load_model(f"{old}_new")
    weights = {name: t for name, t in loaded.state_dict().items() if isinstance(t, torch.Tensor)}
    assert "decoder.layers.0.mixer.in_proj.weight" in weights
    for name, t in expected.state_dict().items():
        if isinstance(t, torch.Tensor):
            assert torch.equal(weights.pop(name), t), name
    assert not weights
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, run.model.vocab_size, (2, 32), generator=g)
    modes = torch.randint(0, 2, (2, 32), generator=g, dtype=torch.int8)
    with torch.no_grad():
        assert torch.equal(loaded(ids, modes), expected(ids, modes))

    # training resumes from it as if it had never stopped
    assert pretrain(run_config(corpus, tmp_path / "split", *split), str(tmp_path / "second_out")) == 0
    resumed = losses(tmp_path / "first_out") + losses(tmp_path / "second_out")
    assert resumed == losses(tmp_path / "straight_out")  # exact, not approximately


LEGACY_ROUTER = Path(__file__).parent / "fixtures/legacy_3486e45/oryx_tg/ckpt/iter_0000001"
OLDER_ROUTER_KEYS = ["router.net.0.weight", "router.net.2.weight"]  # a router of another design


def test_a_checkpoint_holding_keys_the_model_does_not_have_is_refused_in_one_line(tmp_path, capsys):
    """Every key the model has is there, and two more: megatron would ignore them; they are refused."""
    from oryx_megatron.cli.evaluate import main

    model, _ = load_model(str(LEGACY_ROUTER))
    state = model.sharded_state_dict()
    for key in OLDER_ROUTER_KEYS:
        state[key] = ShardedTensor.from_rank_offsets(key, torch.zeros(4, 4))
    ckpt = tmp_path / "iter_0000001"
    ckpt.mkdir()
    dist_checkpointing.save({"model": state, "iteration": 1, "layout": [1, 1, 1]}, str(ckpt))
    shutil.copy(LEGACY_ROUTER / RUN_CONFIG, ckpt / RUN_CONFIG)
    line = f"checkpoint {ckpt} holds keys this model does not have: {', '.join(OLDER_ROUTER_KEYS)} (no migration in "
    with pytest.raises(CheckpointKeysError) as refused:
        load_model(str(ckpt))
    assert str(refused.value).startswith(line) and refused.value.keys == OLDER_ROUTER_KEYS
    with pytest.raises(SystemExit) as exit_info:
        main([str(ckpt), "--task", "ppl", "--out", str(tmp_path / "eval")])
    error_lines = [row for row in capsys.readouterr().err.splitlines() if "error:" in row]
    assert exit_info.value.code == 2 and len(error_lines) == 1 and f"error: {line}" in error_lines[0], error_lines
