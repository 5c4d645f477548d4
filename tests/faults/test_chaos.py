"""oryx-chaos-train in its short configuration: SIGTERM, SIGKILL at a step and SIGKILL inside a save of
the tiny model on synthetic MQAR, in two runs that between them take both optimizers and both save modes: the
plain optimizer with blocking saves, and the distributed optimizer with async saves (the save kill inside a
background write); the kill aimed inside a save (a background write) landed there, as the driver saw it with
the trainer's process group stopped; every restart resumes from the last complete checkpoint, no
checkpoint cut off by a kill holds checksums, and the run ends bitwise equal to the uninterrupted one (losses
of every iteration, weights and optimizer moments) with a final checkpoint that matches its checksums."""

import json

import pytest

from oryx_megatron.checkpoint import CHECKSUMS, METADATA
from oryx_megatron.checks.chaos import driver as chaos_train
from oryx_megatron.checks.chaos import watch
from oryx_megatron.training import saving

KILLS, ITERS, SAVE_INTERVAL = 3, 12, 3  # ~5 process starts of ~8 s each on 2 cores


@pytest.mark.parametrize("options", [[], ["--async-save", "optimizer.use_distributed_optimizer=true"]],
                         ids=["optimizer", "distributed_optimizer_async_save"])
def test_chaos_run_matches_the_uninterrupted_run(tmp_path, options):
    save_aim = "write" if "--async-save" in options else "save"
    args = chaos_train.parse_args([
        "--kills", str(KILLS), "--train-iters", str(ITERS), "--save-interval", str(SAVE_INTERVAL),
        "--seed", "0", "--concurrent-reference", "--attempt-timeout", "300", "--out", str(tmp_path), *options])
    result = chaos_train.chaos(args)
    s = result["summary"]
    assert result["failure"] is None, result["failure"]
    kinds = {(k["signal"], k["aim"]) for k in result["kills"]}
    assert kinds == {("SIGTERM", "step"), ("SIGKILL", "step"), ("SIGKILL", save_aim)}
    assert s["kills_delivered"] == s["kills_survived"] == KILLS, result["kills"]
    assert s["sigterm"] >= 1 and s["sigkill"] >= 1
    assert s["kills_inside_saves"] >= 1, result["kills"]
    assert all(k["landed"] in ("step", "save", "write") for k in result["kills"]), result["kills"]
    assert watch.WRITER_NAME == saving.WRITER_NAME  # how the driver tells the writer processes
    # The aimed kill landed inside what it aimed at, with the group stopped: a save in progress (sync), or a
    # background write, not before it (the save's blocking part had ended: its writer process forked and alive)
    # nor after it (megatron's .metadata not yet written); and it left that save incomplete on disk, without
    # checksums. (megatron-core 0.16 writes common.pt in the blocking part; 0.19 puts the common state in the
    # shards.)
    aimed = [k for k in result["kills"] if k["aim"] == save_aim]
    assert len(aimed) == 1 and s["aimed_kills_off_target"] == 0, result["kills"]
    kill = aimed[0]
    assert kill["landed"] == save_aim and kill["inside_save"], kill
    assert kill["incomplete_iteration"] == kill["landed_iteration"] >= kill["target"], kill
    assert CHECKSUMS not in kill["files_at_kill"] and CHECKSUMS not in kill["incomplete_files"], kill
    if save_aim == "write":
        assert kill["writers_at_kill"] >= 1 and s["kills_landed_inside_writes"] >= 1, kill
        assert METADATA not in kill["files_at_kill"], kill
    assert s["steps_lost_beyond_save_interval"] == 0, result["kills"]
    assert s["iterations_compared"] == ITERS
    assert s["final_loss_diff"] == 0.0 and s["max_loss_diff"] == 0.0
    assert s["max_weight_diff"] == 0.0 and s["max_tensor_diff"] == 0.0 and s["common_state_diff"] == 0.0
    assert s["redone_rows_mismatched"] == 0
    assert s["final_checksums_match"] and s["incomplete_with_checksums"] == 0
    assert s["ok"]
    for kill in result["kills"]:  # each restart resumed from what `latest` named when the process died
        assert kill["resumed_from"] == kill["latest_after"], kill
        if kill["signal"] == "SIGTERM":  # preemption saves first: nothing is redone
            assert kill["exit_code"] == 3 and kill["redone"] == 0, kill
    assert json.loads((tmp_path / "chaos.json").read_text())["summary"] == s
    assert "kills inside saves" in (tmp_path / "summary.md").read_text()
    assert "kills landed inside background writes" in (tmp_path / "summary.md").read_text()


def test_a_late_driver_cannot_let_the_run_end_with_a_kill_pending(tmp_path, monkeypatch):
    """The driver misses the whole first attempt (a loaded machine, as in a CI run where a step kill aimed at
    iteration 7 of 12 reached the trainer after iteration 12 and the two kills after it were never sent): that
    attempt stops by itself at its cap (train.exit_interval), the next one carries the kill, and the run still
    ends bitwise equal to the uninterrupted one."""
    seen = []

    def late(cmd, env, run_dir, ckpt_dir, log_path, kill, *rest):
        seen.append(kill)
        return watch.run_attempt(cmd, env, run_dir, ckpt_dir, log_path, None if len(seen) == 1 else kill, *rest)

    monkeypatch.setattr(chaos_train, "run_attempt", late)
    args = chaos_train.parse_args(["--kills", "1", "--train-iters", "10", "--save-interval", "2", "--seed", "2",
                                   "--concurrent-reference", "--attempt-timeout", "300", "--out", str(tmp_path)])
    result = chaos_train.chaos(args)
    s, (kill,), first = result["summary"], result["kills"], result["attempts"][0]
    assert (kill["signal"], kill["aim"], kill["target"]) == ("SIGKILL", "step", 1)  # the plan of seed 2
    assert chaos_train.attempt_cap(chaos_train.Kill(0, "SIGKILL", "step", 1), 0, 10, 2) == first["cap"] == 5
    assert first["exit_code"] == 0 and first["last_logged"] == first["latest_after"] == 5, first
    assert s["attempts_stopped_at_cap"] == 1 and kill["attempt"] == 1 and kill["exit_code"] == -9, result
    assert s["kills_delivered"] == s["kills_survived"] == 1 and s["ok"], result
    assert s["max_loss_diff"] == 0.0 and s["max_tensor_diff"] == 0.0 and s["iterations_compared"] == 10


def test_attempt_cap():
    kill = chaos_train.Kill(0, "SIGKILL", "save", 7)
    assert chaos_train.attempt_cap(None, 3, 12, 3) is None  # nothing pending: to the end
    assert chaos_train.attempt_cap(kill, 3, 12, 3) == 11  # 7 + 2 * 3 = 13, held before 12
    assert chaos_train.attempt_cap(chaos_train.Kill(0, "SIGKILL", "step", 2), 0, 12, 3) == 8
    assert chaos_train.attempt_cap(kill, 9, 24, 3) == 15  # past the target: from where it resumes
    assert chaos_train.attempt_cap(kill, 11, 12, 3) is None  # only the last iteration is left
    assert chaos_train.attempt_cap(chaos_train.Kill(2, "SIGTERM", "step", 9), 9, 12, 3) is None  # 11 leaves 2 < 3
