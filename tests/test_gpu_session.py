"""tools/bench/gpu_session.py: the CPU rehearsal runs every stage and brings back three flat files; a
stage past its limit is stopped (SIGTERM, then SIGKILL) and the session goes on."""

import importlib.util
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "oryx_megatron" / "checks" / "session" / "driver.py"
STAGES = ["parity", "train_step", "inference", "training", "train_reset", "train_1_4b"]
MAX_FILES = 6  # what the GPU machine's run brings back: at most 8 files, so a budget of 6, no folders


def load_session():
    spec = importlib.util.spec_from_file_location("gpu_session", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cpu_rehearsal_runs_every_stage_within_the_file_budget(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--toy", "--out", str(out), "--work", str(work)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    files = sorted(out.iterdir())
    assert [f.name for f in files] == sorted(load_session().OUT_FILES) and len(files) <= MAX_FILES
    assert all(f.is_file() for f in files)  # flat: nothing a folder deep
    assert not list(work.rglob("*.distcp"))  # the resume check deleted its checkpoints, which were never in out

    results = json.loads((out / "results.json").read_text())
    assert results["header"]["toy"] and results["header"]["versions"]["torch"]
    assert list(results["stages"]) == STAGES
    assert all(stage["exit"] == 0 for stage in results["stages"].values()), results["stages"]
    found = {name: stage["results"] for name, stage in results["stages"].items()}
    for name in ("parity", "training"):  # the GPU check's reports: every row passed
        sections = found[name]["sections"]
        rows = [row for section in sections.values() for row in section["rows"]]
        assert rows and all(row["status"] == "pass" for row in rows), name
    assert set(found["parity"]["sections"]) == {"kernels", "model"}
    assert set(found["training"]["sections"]) == {"training", "performance"}
    assert [(r["model"], r["p_attention"]) for r in found["train_step"]["rows"]] == [
        ("transformer", None), ("attn_only_oryx", None), ("oryx_tm", 0.5), ("oryx_tm", 0.1), ("oryx_tg", 0.5),
        ("oryx_tg", 0.1), ("mamba2", None), ("gdn", None)]
    assert all(r["status"] == "ok" for r in found["train_step"]["rows"])
    schedules = {r["schedule"] for r in found["inference"]["rows"]}
    assert schedules == {"all_attention", "all_linear", "prefill=linear decode=attention", "speculative k=4"}
    assert [(r["model"], r["reset_at_eod"]) for r in found["train_reset"]["rows"]] == [
        (m, reset) for m in ("transformer", "oryx_tm", "oryx_tg") for reset in (False, True)]
    assert [(r["model"], r["recompute"]) for r in found["train_1_4b"]["rows"]] == [
        (m, rc) for m in ("transformer", "oryx_tm", "oryx_tg") for rc in ("none", "selective")]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{s}.log" for s in STAGES} <= names and {"parity/report.md", "training/report.md"} <= names


def test_a_stage_past_its_limit_is_killed_even_if_it_ignores_sigterm(tmp_path, monkeypatch):
    """The training loop catches SIGTERM (it saves for requeue): `timeout` without -k would let it run on."""
    session = load_session()
    monkeypatch.setattr(session, "GRACE_S", 1)
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('started', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    code, seconds = session.run_stage(stubborn, tmp_path / "stage.log", limit_s=2, env={})
    assert code == 124 and time.perf_counter() - start < 20
    assert (tmp_path / "stage.log").read_text() == "started\n"


def test_stages_are_not_started_past_the_deadline(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--toy", "--deadline", "1", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    stages = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert list(stages) == STAGES
    assert all(s["exit"] == "not started: the session's deadline is near" for s in stages.values())
