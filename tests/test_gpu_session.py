"""The GPU session (python -m oryx_megatron.checks.session) rehearsed on CPU: every stage at toy sizes within
the device's file budget, and each failure mode of a rare, short GPU call: a kernel whose probe segfaults is
refused once and every later stage still writes rows; a stage killed mid-way keeps its finished rows (in
results.json while it runs); a CUDA-graph row that fails leaves its eager row; the caps never exceed the
deadline; a stage that ignores SIGTERM is killed."""

import json
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from oryx_megatron.checks import provenance
from oryx_megatron.checks.session import driver, outputs, plan, probes, runner
from oryx_megatron.checks.session.runner import run_stage
from oryx_megatron.ops import OPS
from oryx_megatron.ops import probe as probing

STAGES = ["parity", "training", "train_step", "inference", "training_rest", "train_reset", "train_1_4b"]
MAX_FILES = 8  # what the GPU machine's run brings back: at most 8 files, flat
CRASHED = "chunk_gated_delta_rule"
SEGFAULT = "its probe process was killed by SIGSEGV"


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The whole toy session, with the probe of CRASHED dying by SIGSEGV (causal-conv1d: opt-in, refused)."""
    root = tmp_path_factory.mktemp("session")
    out, work = root / "out", root / "work"
    proc = subprocess.run([sys.executable, "-m", "oryx_megatron.checks.session", "--toy", "--out", str(out),
                           "--work", str(work), "--rehearse-probe-crash", CRASHED],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return out, work, json.loads((out / "results.json").read_text())


def kernel_rows(results: dict, stage: str = "parity") -> list:
    return results["stages"][stage]["results"]["sections"]["kernels"]["rows"]


def test_the_rehearsal_brings_back_flat_files_within_the_budget(rehearsal):
    out, work, results = rehearsal
    files = sorted(out.iterdir())
    assert [f.name for f in files] == sorted(outputs.OUT_FILES) and len(files) <= MAX_FILES
    assert all(f.is_file() for f in files)  # flat: nothing a folder deep
    assert not list(work.rglob("*.distcp"))  # the resume check deleted its checkpoints, which were never in out
    header = results["header"]
    assert header["toy"] and header["versions"]["torch"] and header["source"]["commit"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"{s}.log" for s in STAGES} | {f"probes/{CRASHED}.log", "parity/report.md", "training/report.md"} <= names


def test_a_kernel_whose_probe_segfaults_is_refused_once_and_every_later_stage_writes_rows(rehearsal):
    _, work, results = rehearsal
    found = results["probes"]
    assert found[CRASHED] == {"forward": SEGFAULT, "backward": SEGFAULT, "errors": {},
                              "tolerance": probing.tolerance(CRASHED), "exit": -signal.SIGSEGV,
                              "seconds": found[CRASHED]["seconds"]}
    for op in probes.OPT_IN:  # never run: an installed wheel cannot crash anything
        assert found[op]["forward"] == probes.OPT_IN[op] and found[op]["exit"] is None and found[op]["errors"] == {}
    for op, v in found.items():  # each probed op's errors beside its verdict, and the tolerance that judged them
        assert v["tolerance"] == probing.tolerance(op), op
        if op == CRASHED or op in probes.OPT_IN:
            continue
        assert v["forward"] is None and v["backward"] is None and v["exit"] == 0, op
        forward, backward = v["errors"]["forward"], v["errors"]["backward"]
        gradients = set(backward) - set(forward)
        assert set(forward) == set(OPS[op].outputs) and set(forward) <= set(backward), op
        assert all(name.startswith("d") for name in gradients) and bool(gradients) == OPS[op].backward, op
        assert probing.verdict(op, backward) is None and max(backward.values()) > 0, op  # measured, within tolerance
    verdicts = json.loads((work / "kernel_probes.json").read_text())["verdicts"]
    recorded = ("forward", "backward", "tolerance", "errors")
    assert verdicts == {op: {key: v[key] for key in recorded} for op, v in found.items()}

    assert list(results["stages"]) == STAGES
    assert all(stage["exit"] == 0 for stage in results["stages"].values()), results["stages"]
    for row in kernel_rows(results):  # the later stage read the verdicts: the crashed kernel never ran again
        if row["op"] == CRASHED:
            assert row["status"] == "skipped" and row["note"] == f"skipped: its session probe: {SEGFAULT}"
        elif row["op"] in probes.OPT_IN:
            assert row["status"] == "skipped" and probes.OPT_IN[row["op"]] in row["note"]
        else:
            assert row["status"] == "pass"
    found = {name: stage["results"] for name, stage in results["stages"].items()}
    for name in ("training", "training_rest"):  # the GPU check's report: every row passed, performance at once
        sections = found[name]["sections"]
        assert set(sections) == {"training", "performance"}
        assert all(row["status"] == "pass" for section in sections.values() for row in section["rows"]), name
    assert [r["model"] for r in found["train_step"]["rows"]] == [
        "transformer", "attn_only_oryx", "oryx_tm", "oryx_tm", "oryx_tg", "oryx_tg", "mamba2", "gdn"]
    assert all(r["status"] == "ok" for r in found["train_step"]["rows"])
    assert [(r["model"], r["reset_at_eod"]) for r in found["train_reset"]["rows"]] == [
        (m, reset) for m in ("transformer", "oryx_tm", "oryx_tg") for reset in (False, True)]
    assert [(r["model"], r["recompute"]) for r in found["train_1_4b"]["rows"]] == [
        (m, rc) for m in ("transformer", "oryx_tm", "oryx_tg") for rc in ("none", "selective")]


def test_a_cuda_graph_row_that_fails_leaves_the_eager_row_beside_it(rehearsal):
    _, _, results = rehearsal
    rows = results["stages"]["inference"]["results"]["rows"]
    schedules = ["all_attention", "all_linear", "prefill=linear decode=attention", "speculative k=4"]
    assert [(r["schedule"], r["graphs"]) for r in rows] == [(s, g) for s in schedules for g in (False, True)]
    for eager, graphed in zip(rows[::2], rows[1::2]):
        assert eager["status"] == "ok" and eager["decode_tok_per_s"] > 0
        assert graphed["status"] == "failed" and "CUDA" in graphed["error"]  # no CUDA on this machine


def test_every_process_of_the_session_shares_the_compile_caches(rehearsal):
    _, work, results = rehearsal
    env = results["plan"]["env"]
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
    assert env["TRITON_CACHE_DIR"] == str(work / "triton_cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(work / "inductor_cache")
    assert sum(results["plan"]["caps_s"].values()) <= results["plan"]["deadline_s"]


@pytest.mark.parametrize("toy", [False, True])
def test_the_caps_never_exceed_the_deadline_and_every_stage_gets_its_cap(toy):
    deadline = plan.DEADLINE_S["toy" if toy else "full"]
    for selected, budget in ((plan.stages(toy), deadline), (plan.stages(toy)[3:5], 100), (plan.stages(toy), 200)):
        caps = plan.caps(selected, budget)
        assert list(caps) == [plan.PROBES] + [s.name for s in selected]
        assert sum(caps.values()) <= budget + 1e-9
        used = 0.0  # every step before used its whole cap: each still gets its own, grace included
        for name, cap in caps.items():
            assert plan.limit(name, budget - used, caps) >= cap - plan.GRACE_S - 1e-9
            used += cap
    assert [s.name for s in plan.stages(toy)] == STAGES


def _writes_rows(path, rows, then: str) -> list:
    """A stage that writes ``rows`` to ``path`` one by one, each once the session shows the one before."""
    code = f"""
import json, pathlib, signal, time
path, rows, results = pathlib.Path({str(path)!r}), {rows!r}, pathlib.Path({str(path.parent.parent / "out" / "results.json")!r})
for i in range(len(rows)):
    if i:
        while {path.stem!r} not in results.read_text() or json.loads(results.read_text())["stages"][{path.stem!r}]["results"] != {{"rows": rows[:i]}}:
            time.sleep(0.1)
    path.write_text(json.dumps({{"rows": rows[:i + 1]}}))
{then}
"""
    return ["-c", code]


HANG = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)"


def test_a_stage_cut_mid_way_keeps_its_rows_and_the_session_keeps_its_deadline(tmp_path, monkeypatch):
    """A stage that wrote two rows (the second only once results.json showed the first: rows come home
    while it runs) and then hangs, ignoring SIGTERM, is killed at its limit with both rows kept; the next
    stage runs; a last one that hangs is killed too; the session ends by its deadline."""
    work, deadline = tmp_path / "work", 12
    stages = [plan.Stage("cut", 4, tuple(_writes_rows(work / "cut.json", [1, 2], HANG)), "cut.json"),
              plan.Stage("after", 3, tuple(_writes_rows(work / "after.json", ["a"], "")), "after.json"),
              plan.Stage("stuck", 3, tuple(_writes_rows(work / "stuck.json", [], HANG)), "stuck.json")]
    monkeypatch.setattr(plan, "stages", lambda toy: stages)
    monkeypatch.setattr(runner, "POLL_S", 0.5)  # rows folded in every 0.5 s, not 2 s: the limits can be short
    monkeypatch.setattr(plan, "PROBES_CAP_S", 1)
    monkeypatch.setattr(plan, "GRACE_S", 1)
    monkeypatch.setattr(plan, "MIN_STAGE_S", 1)
    monkeypatch.setattr(driver, "run_probes", lambda *args, **kwargs: {})
    start = time.perf_counter()
    code = driver.main(["--toy", "--deadline", str(deadline), "--out", str(tmp_path / "out"), "--work", str(work)])
    assert code == 1 and time.perf_counter() - start < deadline + 3
    found = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert (found["cut"]["exit"], found["cut"]["results"]) == (124, {"rows": [1, 2]})
    assert found["cut"]["limit"] >= 4 - 1 and found["cut"]["seconds"] >= found["cut"]["limit"]
    assert (found["after"]["exit"], found["after"]["results"]) == (0, {"rows": ["a"]})
    assert found["stuck"]["exit"] == 124 and found["stuck"]["limit"] >= 3 - 1


def test_a_stage_past_its_limit_is_killed_even_if_it_ignores_sigterm(tmp_path):
    """The training loop catches SIGTERM (it saves for requeue): `timeout` without -k would let it run on."""
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                      "print('started', flush=True); time.sleep(60)"]
    start = time.perf_counter()
    code, seconds = run_stage(stubborn, tmp_path, tmp_path / "stage.log", limit_s=2, grace_s=1, env={})
    assert code == 124 and time.perf_counter() - start < 20
    assert (tmp_path / "stage.log").read_text() == "started\n"


def test_a_probe_that_hangs_or_dies_is_refused_with_the_reason(tmp_path):
    log = tmp_path / "probe.log"
    log.write_text("Traceback ...\nImportError: libcudart.so.13: cannot open shared object file\n")
    assert probes.outcome(None, tmp_path / "none.json", log, 60)["forward"] == (
        "its probe process ran past 60 s and was killed")
    assert probes.outcome(-signal.SIGABRT, tmp_path / "none.json", log, 60)["backward"] == (
        "its probe process was killed by SIGABRT")
    assert probes.outcome(1, tmp_path / "none.json", log, 60)["forward"] == (
        "its probe process exited with code 1: ImportError: libcudart.so.13: cannot open shared object file")
    assert probes.outcome(1, tmp_path / "none.json", log, 60)["errors"] == {}
    errors = {"forward": {"o": 2e-3, "final_state": 3e-3}}  # the backward was refused, not run
    (tmp_path / "probe.json").write_text(json.dumps({"forward": None, "backward": "fla issue 640", "errors": errors,
                                                     "device": "cuda"}))
    assert probes.outcome(0, tmp_path / "probe.json", log, 60) == {
        "forward": None, "backward": "fla issue 640", "errors": errors}


def test_stages_are_not_started_past_the_deadline(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "oryx_megatron.checks.session", "--toy", "--deadline", "1",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results["stages"]) == STAGES
    assert all(s["exit"] == "not started: the session's deadline is near" for s in results["stages"].values())
    assert all(v["forward"] and v["exit"] is None for v in results["probes"].values())  # nothing ran unprobed


def test_a_crash_rehearsal_needs_toy(capsys):
    with pytest.raises(SystemExit):
        driver.parse_args(["--out", "/tmp/x", "--rehearse-probe-crash", CRASHED])
    assert "--rehearse-probe-crash is a rehearsal: only with --toy" in capsys.readouterr().err


def test_the_commit_comes_from_the_stamp_where_git_is_not(tmp_path, monkeypatch):
    """.git may not travel to the GPU machine: the commit stamped on the CPU side before the call is read."""
    stamp = tmp_path / "source.json"
    written = provenance.write_stamp(stamp)
    assert written["commit"] == provenance.git_source()["commit"] and "stamped_at" in written
    monkeypatch.setattr(provenance, "git_source", lambda: None)  # as on a machine without .git
    assert provenance.source(stamp) == {**written, "from": str(stamp)}
    assert provenance.source(tmp_path / "none.json")["commit"] is None
    assert "make gpu-stamp" in provenance.source(tmp_path / "none.json")["from"]
