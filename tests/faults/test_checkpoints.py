"""Damaged checkpoints, retention and resume continuity (issue #15, items 2 and 5; issue #30, item 5).

A truncated or missing file of the latest checkpoint, or a shard whose bytes were flipped but whose size is
right (its checksum): resume skips it for the previous good one (logging which and why) and continues with the
losses of an uninterrupted run; oryx-eval stops with one line naming the file. Every checkpoint lists the
checksum of each of its files; one without (written before checksums) still loads. Retention keeps the expected
iterations. After a resume, metrics.jsonl holds each iteration once, the loss curve is drawn from all of it,
and W&B continues the same run. No save logs megatron's "Overwriting old incomplete" warning.
"""

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch

from oryx_megatron import checkpoint
from oryx_megatron.checkpoint import (
    CHECKSUMS,
    RUN_CONFIG,
    CheckpointError,
    ChecksumMismatch,
    apply_retention,
    file_sha256,
    verify_checkpoint,
)
from oryx_megatron.checkpoint.checksums import read_checksums, verify_checksums
from oryx_megatron.compat.megatron import common_state_location
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.training import metrics
from oryx_megatron.training.loop import pretrain
from tests.test_train import losses, run_config

# 6 iterations of a 1-layer model, a checkpoint every 2
COMMON = ["model.num_layers=1", "train.train_iters=6", "checkpoint.save_interval=2"]
OVERWRITE_WARNING = "Overwriting old incomplete"


def training_rows(output_dir):
    """The rows of metrics.jsonl that training steps logged (not the checkpoint/ rows of saves)."""
    rows = [json.loads(line) for line in (Path(output_dir) / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "train/loss" in row]


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """train/loss of 6 uninterrupted iterations."""
    tmp = tmp_path_factory.mktemp("straight")
    assert pretrain(run_config(corpus, tmp, "model.num_layers=1", "train.train_iters=6"), str(tmp / "out")) == 0
    return losses(tmp / "out")


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory):
    """A run stopped after 4 of its 6 iterations: checkpoints at 2 and 4 (`latest`), metrics of 1..4."""
    tmp = tmp_path_factory.mktemp("stopped")
    assert pretrain(run_config(corpus, tmp, *COMMON, "train.exit_interval=4"), str(tmp / "out")) == 0
    assert (tmp / "ckpt/latest").read_text().strip() == "iter_0000004"
    return tmp


def copy_of(stopped: Path, tmp_path: Path) -> Path:
    shutil.copytree(stopped, tmp_path / "run")
    return tmp_path / "run"


def truncate(file: Path) -> None:
    os.truncate(file, file.stat().st_size // 2)


def largest(storage_data: dict):
    """The MetadataIndex of the largest item of a ``.metadata``'s storage_data (the largest tensor)."""
    return max(storage_data, key=lambda index: storage_data[index].length)


def largest_tensor(ckpt: Path):
    """Where the bytes of a checkpoint's largest tensor lie: (shard file name, offset, length)."""
    storage = pickle.loads((ckpt / ".metadata").read_bytes()).storage_data
    info = storage[largest(storage)]
    return info.relative_path, info.offset, info.length


def version_dependent_names(ckpt: Path) -> dict:
    """The names in a checkpoint that depend on megatron-core's version: its first and last shard file
    (two per rank up to 0.16, one from 0.17), its largest tensor and the shard holding it, and where the
    common state lies (common.pt up to 0.18, an object inside a shard from 0.19)."""
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    where = common_state_location(ckpt, pickle.loads((ckpt / ".metadata").read_bytes()))
    storage = pickle.loads((ckpt / ".metadata").read_bytes()).storage_data
    return {"first_shard": shards[0], "last_shard": shards[-1], "tensor_shard": largest_tensor(ckpt)[0],
            "common_state": where.name, "largest_tensor": largest(storage).fqn}


def flip_a_byte(file: Path) -> None:
    """Invert a byte in the middle of the checkpoint's largest tensor (in ``file``), which keeps its length."""
    _, offset, length = largest_tensor(file.parent)
    with open(file, "r+b") as f:
        f.seek(offset + length // 2)
        byte = f.read(1)[0]
        f.seek(offset + length // 2)
        f.write(bytes([byte ^ 0xFF]))


def unplace_the_largest_tensor(metadata: Path) -> None:
    """Drop from ``.metadata``'s storage_data where the checkpoint's largest tensor lies (it still lists it)."""
    loaded = pickle.loads(metadata.read_bytes())
    del loaded.storage_data[largest(loaded.storage_data)]
    metadata.write_bytes(pickle.dumps(loaded))


def zero_common_state(ckpt: Path) -> None:
    """Zero the bytes of the common state where the save put it (each file keeps its length)."""
    where = common_state_location(ckpt, pickle.loads((ckpt / ".metadata").read_bytes()))
    with open(ckpt / where.file, "r+b") as f:
        f.seek(where.offset)
        f.write(bytes(where.length))


DAMAGES = {  # name: (file of iter_0000004, what is done to it, the reason logged); {names}: version_dependent_names
    "shard": ("{first_shard}", truncate, "{first_shard} is truncated ("),
    "shard_bytes": ("{tensor_shard}", flip_a_byte, "{tensor_shard} does not match its checksum (sha256 "),
    "last_shard": ("{last_shard}", Path.unlink, "{last_shard} is missing (named by .metadata)"),
    "common": (".", zero_common_state, "{common_state} is truncated or unreadable ("),
    "metadata": (".metadata", truncate, ".metadata is truncated or unreadable ("),
    "metadata_storage": (".metadata", unplace_the_largest_tensor, ".metadata lists {largest_tensor} in no shard file"),
    "metadata_json": ("metadata.json", Path.unlink, "metadata.json is missing"),
    "run_config": ("run_config.yaml", lambda f: f.write_text(""), "run_config.yaml is truncated or unreadable ("),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_checkpoint_is_skipped_and_training_continues_exactly(corpus, stopped, straight, tmp_path,
                                                                         caplog, damage):
    file, spoil, reason = DAMAGES[damage]
    run = copy_of(stopped, tmp_path)
    names = version_dependent_names(run / "ckpt/iter_0000004")
    spoil(run / "ckpt/iter_0000004" / file.format(**names))
    reason = reason.format(**names)
    with caplog.at_level(logging.INFO):
        assert pretrain(run_config(corpus, run, *COMMON), str(run / "out")) == 0
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping damaged checkpoint")]
    assert len(skipped) == 1 and skipped[0].startswith(
        f"skipping damaged checkpoint {run / 'ckpt/iter_0000004'}: {reason}"), skipped
    assert f"resumed from {run / 'ckpt/iter_0000002'} at iteration 2" in caplog.text
    assert OVERWRITE_WARNING not in caplog.text
    # metrics.jsonl: 1..2 of the stopped run (3, 4 dropped: not in iter_2), 3..6 of this one
    assert [row["iteration"] for row in training_rows(run / "out")] == [1, 2, 3, 4, 5, 6]
    assert losses(run / "out") == straight  # exact, not approximately
    assert (run / "ckpt/latest").read_text().strip() == "iter_0000006"
    verify_checkpoint(run / "ckpt/iter_0000004")  # saved again, intact


def test_a_save_cut_off_before_latest_moved_is_replaced(corpus, stopped, straight, tmp_path, caplog):
    """A crash after megatron's files but before run_config.yaml and `latest`: `latest` still
    names iter_2, the leftover iter_4 is removed and saved again, without megatron's warning."""
    run = copy_of(stopped, tmp_path)
    (run / "ckpt/iter_0000004/run_config.yaml").unlink()
    (run / "ckpt/latest").write_text("iter_0000002\n")
    with caplog.at_level(logging.INFO):
        assert pretrain(run_config(corpus, run, *COMMON), str(run / "out")) == 0
    assert "skipping damaged checkpoint" not in caplog.text
    assert f"removing {run / 'ckpt/iter_0000004'}: a save of iteration 4 that did not finish" in caplog.text
    assert OVERWRITE_WARNING not in caplog.text
    assert losses(run / "out") == straight
    verify_checkpoint(run / "ckpt/iter_0000004")


def test_saves_log_no_overwriting_warning(corpus, tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        assert pretrain(run_config(corpus, tmp_path, "model.num_layers=1", "train.train_iters=2",
                                   "checkpoint.save_interval=1"), str(tmp_path / "out")) == 0
    assert caplog.text.count("saved ") == 2
    assert OVERWRITE_WARNING not in caplog.text


def test_no_intact_checkpoint_is_one_error(stopped, tmp_path):
    run = copy_of(stopped, tmp_path)
    for it in ("iter_0000002", "iter_0000004"):
        (run / "ckpt" / it / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match=r"iter_0000004 is damaged: metadata.json is missing; no older"):
        checkpoint.latest_checkpoint(str(run / "ckpt"))


class _Payload:
    def __reduce__(self):
        return print, ("code ran while unpickling",)


def test_a_pickle_that_would_run_code_is_refused(stopped, tmp_path, capsys):
    run = copy_of(stopped, tmp_path)
    (run / "ckpt/iter_0000004/.metadata").write_bytes(pickle.dumps(_Payload()))
    with pytest.raises(CheckpointError, match=r"\.metadata is truncated or unreadable .*refuses to load global builtins.print"):
        verify_checkpoint(run / "ckpt/iter_0000004")
    torch.save({"iteration": 4, "x": _Payload()}, run / "ckpt/iter_0000002/common.pt")
    with pytest.raises(CheckpointError, match=r"common\.pt is truncated or unreadable"):
        verify_checkpoint(run / "ckpt/iter_0000002")
    assert "code ran" not in capsys.readouterr().out


def test_a_checkpoint_of_an_unknown_format_version_is_refused_by_name(stopped, tmp_path, capsys):
    """Checkpoints record their layout's format_version; one this code does not know is refused in one line naming
    the checkpoint and the version, by every reader (not skipped as damaged when resuming). Checkpoints without
    one (tests/fixtures/legacy_*) load as layout 1 (tests/test_legacy_checkpoints.py)."""
    from oryx_megatron.cli.generate import main

    run = copy_of(stopped, tmp_path)
    common = checkpoint.load_common(run / "ckpt/iter_0000004")
    assert common["format_version"] == checkpoint.FORMAT_VERSION == 1
    torch.save({**common, "format_version": 7}, run / "ckpt/iter_0000004/common.pt")
    message = (f"checkpoint {run / 'ckpt/iter_0000004'} has format_version=7, which this oryx-megatron does not "
               f"know (it reads 1): written by a newer version?")
    with pytest.raises(checkpoint.CheckpointVersionError) as refused:
        checkpoint.latest_checkpoint(str(run / "ckpt"))
    assert str(refused.value) == message
    with pytest.raises(SystemExit):
        main([str(run / "ckpt"), "--prompt", "x", "--max-new-tokens", "1"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


@pytest.mark.parametrize("target", ["run_dir", "iteration_dir"])
def test_oryx_eval_on_a_damaged_checkpoint_is_one_line(stopped, tmp_path, capsys, target):
    from oryx_megatron.cli.evaluate import main

    run = copy_of(stopped, tmp_path)
    truncate(run / "ckpt/iter_0000004/__0_0.distcp")
    arg = run / "ckpt" if target == "run_dir" else run / "ckpt/iter_0000004"
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg), "--task", "ppl", "--out", str(tmp_path / "eval")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1, err
    assert (f"error: checkpoint {run / 'ckpt/iter_0000004'} is damaged: __0_0.distcp is truncated ("
            in error_lines[0]), err
    with pytest.raises(CheckpointError, match="__0_0.distcp is truncated"):  # inference loading, no fallback
        load_model(str(run / "ckpt"))


def test_oryx_eval_on_flipped_bytes_is_one_line(stopped, tmp_path, capsys):
    from oryx_megatron.cli.evaluate import main

    ckpt = copy_of(stopped, tmp_path) / "ckpt/iter_0000004"
    shard = largest_tensor(ckpt)[0]
    flip_a_byte(ckpt / shard)
    with pytest.raises(SystemExit) as exit_info:
        main([str(ckpt.parent), "--task", "ppl", "--out", str(tmp_path / "eval")])
    assert exit_info.value.code == 2
    error_lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and (f"error: checkpoint {ckpt} is damaged: {shard} does not match its checksum "
                                      "(sha256 " in error_lines[0]), error_lines


def test_every_file_has_a_checksum_written_last(stopped):
    ckpt = stopped / "ckpt/iter_0000004"
    listed = dict(reversed(line.split("  ", 1)) for line in (ckpt / CHECKSUMS).read_text().splitlines())
    assert set(listed) == {p.name for p in ckpt.iterdir()} - {CHECKSUMS}  # sha256sum's format, every file
    assert all(file_sha256(ckpt / name) == sha for name, sha in listed.items())
    assert (ckpt / CHECKSUMS).stat().st_mtime_ns >= max(p.stat().st_mtime_ns for p in ckpt.iterdir())


# Each file a checkpoint's checksums list, one case each, by role: the shard names and where the common state lies
# depend on megatron-core's version (version_dependent_names; common.pt is written up to 0.18 only).
LISTED = {"first_shard": "{first_shard}", "last_shard": "{last_shard}", "common.pt": "common.pt",
          ".metadata": ".metadata", "metadata.json": "metadata.json", "run_config.yaml": "run_config.yaml"}


def listed_file(ckpt: Path, role: str):
    """The file of ``ckpt`` that plays ``role``, or None where this megatron-core writes none."""
    name = LISTED[role].format(**version_dependent_names(ckpt))
    return name if (ckpt / name).is_file() else None


def test_the_flipped_byte_cases_cover_every_file_the_checksums_list(stopped):
    ckpt = stopped / "ckpt/iter_0000004"
    assert set(read_checksums(ckpt)) == {listed_file(ckpt, role) for role in LISTED} - {None}


@pytest.mark.parametrize("role", list(LISTED))
def test_a_flipped_byte_in_each_file_the_checksums_list_is_found(stopped, tmp_path, role):
    """One byte inverted in the middle of the file (its length kept): the checksums name that file, and so does
    the verification before a load, whichever of its checks comes first."""
    ckpt = copy_of(stopped, tmp_path) / "ckpt/iter_0000004"
    name = listed_file(ckpt, role)
    if name is None:
        pytest.skip(f"this megatron-core writes no {role}")
    with open(ckpt / name, "r+b") as f:
        middle = (ckpt / name).stat().st_size // 2
        f.seek(middle)
        byte = f.read(1)[0]
        f.seek(middle)
        f.write(bytes([byte ^ 0xFF]))
    with pytest.raises(ChecksumMismatch, match=rf"iter_0000004 is damaged: {re.escape(name)} does not match its checksum"):
        verify_checksums(ckpt)
    with pytest.raises(CheckpointError, match=rf"iter_0000004 is damaged: {re.escape(name)} "):
        verify_checkpoint(ckpt)


def test_a_checkpoint_without_checksums_loads_as_before(stopped, tmp_path):
    """A checkpoint written before checksums: its structure is verified, its bytes cannot be."""
    run = copy_of(stopped, tmp_path)
    (run / "ckpt/iter_0000004" / CHECKSUMS).unlink()
    verify_checkpoint(run / "ckpt/iter_0000004")
    assert checkpoint.latest_checkpoint(str(run / "ckpt")) == run / "ckpt/iter_0000004"


def test_a_checksum_file_names_the_file_that_differs(stopped, tmp_path):
    ckpt = copy_of(stopped, tmp_path) / "ckpt/iter_0000004"
    recorded = (ckpt / CHECKSUMS).read_text()
    with open(ckpt / RUN_CONFIG, "a") as f:  # still a valid run config
        f.write("# edited\n")
    with pytest.raises(ChecksumMismatch, match=r"iter_0000004 is damaged: run_config.yaml does not match its checksum"):
        verify_checkpoint(ckpt)
    (ckpt / CHECKSUMS).write_text(recorded + f"{'0' * 64}  gone.distcp\n")
    with pytest.raises(CheckpointError, match=r"gone.distcp is missing \(named by checksums.sha256\)"):
        verify_checkpoint(ckpt, checksums=True)
    (ckpt / CHECKSUMS).write_text("0123  common.pt\n")
    with pytest.raises(CheckpointError, match=r"checksums.sha256 is unreadable \(line 1 is not '<sha256>  <file>'\)"):
        verify_checkpoint(ckpt)


def test_retention_keeps_the_newest_and_every_mth(corpus, tmp_path):
    run = run_config(corpus, tmp_path, "model.num_layers=1", "train.train_iters=5", "checkpoint.save_interval=1",
                     "checkpoint.keep_last=2", "checkpoint.keep_every=2")
    assert pretrain(run, str(tmp_path / "out")) == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "iter_0000002", "iter_0000004", "iter_0000005", "latest"]


def test_retention_never_deletes_latest_nor_unfinished_saves(tmp_path):
    for it in range(1, 11):
        (tmp_path / f"iter_{it:07d}").mkdir()
    (tmp_path / "latest").write_text("iter_0000008\n")  # 9, 10: saves that did not finish
    deleted = apply_retention(str(tmp_path), keep_last=1, keep_every=3)
    assert sorted(p.name for p in deleted) == [f"iter_{it:07d}" for it in (1, 2, 4, 5, 7)]
    assert apply_retention(str(tmp_path), keep_last=None, keep_every=None) == []


def test_resume_continues_the_metrics_curve_and_the_wandb_run(corpus, tmp_path, monkeypatch):
    plotted = []
    plot = metrics.plot_loss_curve
    monkeypatch.setattr(metrics, "plot_loss_curve",
                        lambda history, path: plotted.append([r["iteration"] for r in history if "train/loss" in r])
                        or plot(history, path))
    args = ["model.num_layers=1", "train.train_iters=3", "train.exit_interval=2", "checkpoint.save_at_end=true",
            "logging.wandb_mode=offline"]
    out = tmp_path / "out"
    assert pretrain(run_config(corpus, tmp_path, *args), str(out)) == 0  # 1, 2, saved at 2
    with open(out / "metrics.jsonl", "a") as f:  # an iteration logged after the last save, then a crash
        f.write(json.dumps({"iteration": 3, "train/loss": 9.0}) + "\n")
    assert pretrain(run_config(corpus, tmp_path, *args), str(out)) == 0  # 3, saved at 3
    assert [row["iteration"] for row in training_rows(out)] == [1, 2, 3]
    assert 9.0 not in losses(out)
    assert plotted == [[1, 2], [1, 2, 3]]
    assert (out / "loss_curve.png").stat().st_size > 0
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2, runs
    # each offline run holds run-<id>.wandb (its folder name gets a "-1" suffix when both start in one second)
    ids = {f.stem.split("-", 1)[1] for r in runs for f in r.glob("run-*.wandb")}
    saved_id = checkpoint.load_common(tmp_path / "ckpt/iter_0000003")["run_id"]
    assert ids == {saved_id}
