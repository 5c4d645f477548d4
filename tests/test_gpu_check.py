"""oryx-gpu-check's CPU dry run, end to end at toy sizes, and a broken section becoming a failed row.

What the dry run covers, plainly: without CUDA the CUDA wrappers run the torch op, so its kernel rows
compare the torch op in bf16 with itself in fp64 and its model rows compare the torch ops with themselves;
those rows prove the code of every section runs, names every op and case, writes the report as it goes and
labels itself a dry run, not that any kernel is right. What the comparison itself catches is proved here by
injection: a wrong kernel (a mutant of the torch op) put in place of a CUDA wrapper fails its rows, a
refused one is skipped, a crashed session probe skips its rows. On a machine with CUDA these tests are
skipped: run `make gpu-check` there.
"""

import dataclasses
import json
import math

import pytest
import torch

from oryx_megatron import ops
from oryx_megatron.checks.gpu_check import command as gpu_check
from oryx_megatron.checks.gpu_check import kernels, model, report as gpu_report, setup as gpu_setup

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; with CUDA run `make gpu-check`")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("gpu_check")
    code = gpu_check.main(["--out", str(out)])
    return code, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def rows(report, section):
    return report["sections"][section]["rows"]


def kernel_section(out):
    """(setup, report) of a kernel section at toy sizes on CPU."""
    setup = gpu_setup.Setup(torch.device("cpu"), gpu_setup.TOY, out, ())
    return setup, gpu_report.Report(out, gpu_check.make_header(setup, []))


def test_dry_run_passes_and_is_labelled(dry_run):
    code, report, markdown = dry_run
    assert code == 0 and report["summary"]["fail"] == 0
    header = report["header"]
    assert header["dry_run"] and header["toy"] and header["device"] == "CPU (dry run)"
    assert header["label"] == gpu_setup.DRY_RUN_LABEL == "CPU dry run: nothing here ran on a GPU"
    assert header["versions"]["torch"] == torch.__version__
    assert set(header["versions"]) >= {"triton", "megatron-core", "fla", "mamba-ssm", "causal-conv1d",
                                       "transformer-engine"}
    assert header["kernels_auto"] == ops.get_kernels("auto").names
    assert header["source"]["commit"] and header["source"]["from"] == "git"
    assert list(report["sections"]) == ["kernels", "model", "training", "performance"]
    assert all(entry["status"] == "done" for entry in report["sections"].values())
    assert f"**{gpu_setup.DRY_RUN_LABEL}.**" in markdown
    for title in gpu_report.SECTION_TITLES.values():
        assert f"## {title}" in markdown
    assert "| op | case | implementation | errors | tolerance | status | note |" in markdown


def test_every_kernel_op_has_its_rows(dry_run):
    _, report, _ = dry_run
    kernel_rows = rows(report, "kernels")
    assert {row["op"] for row in kernel_rows} == set(ops.cuda_ops())
    cases = {(row["op"], row["case"]) for row in kernel_rows}
    for op in ("causal_conv1d", "chunk_gated_delta_rule", "ssd_chunk_scan"):
        for direction in ("fwd", "bwd"):
            assert {(op, f"{direction}, no initial state"), (op, f"{direction}, initial state")} <= cases
    for row in kernel_rows:
        assert row["status"] == "pass" and row["implementation"] == "torch"
        assert row["tolerance"] == gpu_setup.KERNEL_RTOL
        assert "the CUDA wrapper ran the torch op" in row["note"]  # a dry run says what it compared
        assert all(0 <= e <= row["tolerance"] for e in row["errors"].values())
    chunked_bwd = next(r for r in kernel_rows if (r["op"], r["case"]) == ("chunk_gated_delta_rule", "bwd, initial state"))
    assert set(chunked_bwd["errors"]) == {"dq", "dk", "dv", "dg", "dbeta", "dinitial_state"}
    conv = next(r for r in kernel_rows if (r["op"], r["case"]) == ("causal_conv1d", "fwd, initial state"))
    assert set(conv["errors"]) == {"y", "final_state"}


def test_model_section_has_both_families(dry_run):
    _, report, _ = dry_run
    model_rows = rows(report, "model")
    assert {row["family"] for row in model_rows} == {"oryx_tg", "oryx_tm"}
    assert len(model_rows) == 2 * (1 + len(gpu_setup.DECODE_SCHEDULES)) == model.model_rows()
    for row in model_rows:
        assert row["status"] == "pass" and "torch compared with itself" in row["note"]
    logits = [row for row in model_rows if row["check"] == "parallel logits"]
    assert [row["errors"]["logits"] for row in logits] == [0.0, 0.0]  # the same torch ops on the same weights


def test_training_and_performance_cover_every_family(dry_run):
    _, report, _ = dry_run
    training, performance = rows(report, "training"), rows(report, "performance")
    families = ["transformer", "mamba2", "gdn", "oryx_tm", "oryx_tg"]
    assert [row["family"] for row in training] == [row["family"] for row in performance] == families
    for row in training:
        assert row["status"] == "pass" and row["iterations"] == 8
        assert math.isfinite(row["loss_first"]) and math.isfinite(row["loss_last"]) and row["finite"]
        assert row["falling"] and row["loss_last"] < row["loss_first"]
        assert row["resume_max_abs_diff"] == 0.0 and row["diff_before_resume"] == 0.0  # CPU fp32: exact
    for row in performance:
        assert row["status"] == "pass" and row["tokens_per_s"] > 0 and row["memory_gb"] > 0
        assert "not a GPU measurement" in row["note"]


def test_a_raising_section_becomes_a_failed_row(tmp_path, monkeypatch):
    def broken(setup, report):
        raise RuntimeError("injected failure")

    monkeypatch.setitem(gpu_check.SECTIONS, "model", broken)
    code = gpu_check.main(["--out", str(tmp_path), "--sections", "model", "training", "--families", "no_such_family"])
    assert code == 1
    report = json.loads((tmp_path / "report.json").read_text())
    [model_row] = rows(report, "model")
    assert model_row["status"] == "fail" and "section model raised RuntimeError: injected failure" in model_row["note"]
    [train_row] = rows(report, "training")  # the unknown family fails its own row, not the section
    assert train_row["status"] == "fail" and "no_such_family" in train_row["note"]
    [perf_row] = rows(report, "performance")
    assert perf_row["status"] == "fail" and "no training metrics" in perf_row["note"]
    assert report["summary"] == {"pass": 0, "fail": 3, "skipped": 0}
    assert "injected failure" in (tmp_path / "report.md").read_text()


def test_a_kernel_that_cannot_run_is_skipped_not_failed(tmp_path, monkeypatch):
    """The skip path of a GPU machine without the kernel packages, reached here by injection:
    nothing is measured, every row says why."""
    setup, report = kernel_section(tmp_path)  # honestly labelled a dry run
    monkeypatch.setattr(gpu_setup.Setup, "dry_run", property(lambda self: False))
    monkeypatch.setattr(kernels.selection, "refusal", lambda op, env, backward=True: f"{op}: injected refusal")
    with report.section("kernels", kernels.kernel_rows()):
        kernels.check_kernels(setup, report)
    kernel_rows = rows(report.data, "kernels")
    assert len(kernel_rows) == kernels.kernel_rows()
    for row in kernel_rows:
        assert row["status"] == "skipped" and row["note"] == f"skipped: {row['op']}: injected refusal"
        assert "errors" not in row
    assert report.exit_code() == 0


def test_a_backward_only_refusal_skips_the_backward_rows_only(tmp_path, monkeypatch):
    """fla issue 640 refuses the gated delta rule's backward on Hopper: its forward rows still measure."""
    setup, report = kernel_section(tmp_path)
    monkeypatch.setattr(gpu_setup.Setup, "dry_run", property(lambda self: False))
    monkeypatch.setattr(kernels.selection, "refusal", lambda op, env, backward=True: (
        "injected backward refusal" if backward and op == "chunk_gated_delta_rule" else None))
    with report.section("kernels", kernels.kernel_rows()):
        kernels.check_kernels(setup, report)
    gdn = [row for row in rows(report.data, "kernels") if row["op"] == "chunk_gated_delta_rule"]
    assert [(row["case"].split(",")[0], row["status"]) for row in gdn] == [
        ("fwd", "pass"), ("bwd", "skipped"), ("fwd", "pass"), ("bwd", "skipped")]
    assert all(row["status"] == "pass" for row in rows(report.data, "kernels") if row["op"] != "chunk_gated_delta_rule")


def _gradient_times(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x in the forward; its gradient multiplied by ``factor`` in the backward."""
    return x * factor - (x * (factor - 1)).detach()


def test_a_wrong_kernel_fails_its_rows_forward_and_backward(tmp_path, monkeypatch):
    """The comparison is no tautology: a CUDA wrapper that computes something else fails its rows, one
    that is right forward but wrong backward fails its backward rows only; every other op still passes."""
    def wrong_scan(x, dt, A, B, C, D=None, initial_state=None, output_final_state=True, chunk_size=64, **kwargs):
        return ops.ssd_chunk_scan(x, dt * 1.1, A, B, C, D, initial_state, output_final_state, chunk_size, **kwargs)

    def wrong_norm_gradient(y, gate, weight, eps=1e-5):
        return ops.gated_rms_norm(_gradient_times(y, 1.1), gate, weight, eps)

    for op, wrong in (("ssd_chunk_scan", wrong_scan), ("gated_rms_norm", wrong_norm_gradient)):
        monkeypatch.setitem(ops.OPS, op, dataclasses.replace(ops.OPS[op], cuda=wrong))  # its declared CUDA kernel
    setup, report = kernel_section(tmp_path)
    with report.section("kernels", kernels.kernel_rows()):
        kernels.check_kernels(setup, report)
    status = {(row["op"], row["case"]): row["status"] for row in rows(report.data, "kernels")}
    assert {case: s for (op, case), s in status.items() if op == "ssd_chunk_scan"} == {
        "fwd, no initial state": "fail", "bwd, no initial state": "fail",
        "fwd, initial state": "fail", "bwd, initial state": "fail"}
    assert {case: s for (op, case), s in status.items() if op == "gated_rms_norm"} == {
        "fwd, per head": "pass", "bwd, per head": "fail"}
    assert {s for (op, _), s in status.items() if op not in ("ssd_chunk_scan", "gated_rms_norm")} == {"pass"}
    norm_bwd = next(r for r in rows(report.data, "kernels") if (r["op"], r["case"]) == ("gated_rms_norm", "bwd, per head"))
    assert norm_bwd["errors"]["dy"] > gpu_setup.KERNEL_RTOL >= norm_bwd["errors"]["dgate"]


def test_a_kernel_whose_session_probe_crashed_is_skipped_even_in_a_dry_run(tmp_path, monkeypatch):
    """The GPU session probes every kernel once, in its own process; a kernel whose probe died is not
    called again by any later stage: its rows are skipped with the recorded reason (a verdict recorded
    under another tolerance than this checkout's is not a reason)."""
    verdicts = tmp_path / "kernel_probes.json"
    crashed = "its probe process was killed by SIGSEGV"
    recorded = {"forward": crashed, "backward": crashed, "errors": {}}
    verdicts.write_text(json.dumps({"verdicts": {
        "chunk_gated_delta_rule": {**recorded, "tolerance": ops.probe.tolerance("chunk_gated_delta_rule")},
        "ssd_chunk_scan": {**recorded, "tolerance": {"*": 5e-2}}}}))  # another checkout's: measured here
    monkeypatch.setenv(ops.probe.PROBES_ENV_VAR, str(verdicts))

    def crash(*args, **kwargs):
        raise AssertionError("a kernel refused by its session probe was called")

    gdn = ops.OPS["chunk_gated_delta_rule"]
    monkeypatch.setitem(ops.OPS, gdn.name, dataclasses.replace(gdn, cuda=crash))
    setup, report = kernel_section(tmp_path / "out")
    with report.section("kernels", kernels.kernel_rows()):
        kernels.check_kernels(setup, report)
    gdn = [row for row in rows(report.data, "kernels") if row["op"] == "chunk_gated_delta_rule"]
    assert len(gdn) == 4 and all(row["note"] == f"skipped: its session probe: {crashed}" for row in gdn)
    assert all(row["status"] == "pass" for row in rows(report.data, "kernels") if row["op"] != "chunk_gated_delta_rule")
