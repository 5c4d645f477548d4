"""The GPU check's report: rows by section in report.json and report.md, rewritten after every row."""

import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from tqdm import tqdm

from oryx_megatron.checks.gpu_check.setup import DRY_RUN_LABEL
from oryx_megatron.eval.reporting import write_json

MAX_CELL = 400  # characters of a markdown cell

SECTION_COLUMNS = {
    "kernels": ("op", "case", "implementation", "errors", "tolerance", "status", "note"),
    "model": ("family", "check", "backends", "errors", "tolerance", "status", "note"),
    "training": ("family", "iterations", "loss_first", "loss_last", "finite", "falling",
                 "resume_max_abs_diff", "diff_before_resume", "tolerance", "status", "note"),
    "performance": ("family", "tokens_per_s", "mfu", "memory_gb", "status", "note"),
}
SECTION_TITLES = {
    "kernels": "a. kernels: CUDA kernel vs torch op in fp64 (relative error max|x-ref|/max|ref|)",
    "model": "b. model: CUDA vs torch kernels, cached decode vs parallel forward (logits, relative error)",
    "training": "c. training: MQAR, finite and falling loss, resume vs uninterrupted run (loss, absolute)",
    "performance": "d. performance: from section c's uninterrupted runs (medians after the first steps), "
                   "each row right after its family's training row",
}


class Report:
    """Rows by section, rewritten to report.json and report.md from the start (the header alone) and
    after every row: a run cut at any moment leaves what it finished."""

    def __init__(self, out: Path, header: dict):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {"header": header, "sections": {}, "summary": {}}
        self.bar: Optional[tqdm] = None
        self.name, self.opened = None, []  # the section being run, and the sections it wrote rows to
        self.write()

    @contextmanager
    def section(self, name: str, total: int):
        """Rows added inside belong to `name` (or the section named in ``add``); an exception becomes
        a failed row and ends the section."""
        self.name, self.opened, start = name, [name], time.perf_counter()
        self._entry(name)
        self.bar = tqdm(total=total, desc=f"{name:<11}", unit="check", file=sys.stderr, dynamic_ncols=True)
        self.write()
        try:
            yield
            status = "done"
        except Exception as e:
            self.add(failed({}, e, prefix=f"section {name} raised "))
            status = "done"
        finally:  # also on Ctrl-C: what ran stays in the report, the section marked "running"
            for opened in self.opened:
                self.data["sections"][opened]["seconds"] = round(time.perf_counter() - start, 2)
            self.bar.close()
            self.write()
        for opened in self.opened:
            self.data["sections"][opened]["status"] = status
        self.write()

    def _entry(self, name: str) -> dict:
        if name not in self.data["sections"]:
            self.data["sections"][name] = {"status": "running", "rows": [], "seconds": None}
        return self.data["sections"][name]

    def add(self, row: dict, section: Optional[str] = None) -> None:
        """Append ``row`` to ``section`` (default: the one being run) and rewrite the report."""
        section = section or self.name
        if section not in self.opened:
            self.opened.append(section)
        self._entry(section)["rows"].append(row)
        self.bar.update(1)
        cells = [f"{key}={_cell(row[key])}" for key in SECTION_COLUMNS[section][:-2] if key in row]
        self.bar.write(f"  {row['status'].upper():<7} {' '.join(cells)}  {row.get('note', '')}".rstrip())
        self.write()

    def exit_code(self) -> int:
        return 1 if self.data["summary"]["fail"] else 0

    def write(self) -> None:
        rows = [row for entry in self.data["sections"].values() for row in entry["rows"]]
        self.data["summary"] = {s: sum(row["status"] == s for row in rows) for s in ("pass", "fail", "skipped")}
        write_json(self.out / "report.json", self.data)
        (self.out / "report.md").write_text(render_markdown(self.data))


def render_markdown(data: dict) -> str:
    header, summary = data["header"], data["summary"]
    lines = ["# oryx-gpu-check report", ""]
    if header["dry_run"]:
        lines += [f"**{DRY_RUN_LABEL}.** Toy sizes; the CUDA wrappers fell back to the torch ops.", ""]
    lines += [f"Result: {summary['pass']} passed, {summary['fail']} failed, {summary['skipped']} skipped.", ""]
    facts = {k: header[k] for k in ("date", "device", "compute_capability", "nvcc", "toy", "command", "source",
                                    "python")}
    lines += _table(("", ""), [(k, v) for k, v in facts.items()])
    lines += ["", "## Versions", ""] + _table(("package", "version"), header["versions"].items())
    chosen = header["kernels_auto"] or {"": "not chosen yet"}
    lines += ["", '## Kernels chosen by get_kernels("auto")', ""] + _table(("op", "implementation"), chosen.items())
    for name, entry in data["sections"].items():
        columns = SECTION_COLUMNS[name]
        lines += ["", f"## {SECTION_TITLES[name]}", "", f"{entry['status']}, {entry['seconds']} s", ""]
        lines += _table(columns, [[row.get(c) for c in columns] for row in entry["rows"]])
    return "\n".join(lines) + "\n"


def _table(columns: Sequence[str], rows) -> List[str]:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return out + ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    if isinstance(value, float):
        if value == 0 or 1e-2 <= abs(value) < 1e3:
            return f"{value:.3g}"
        return f"{value:,.0f}" if 1e3 <= abs(value) < 1e12 else f"{value:.2e}"
    text = str(value).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= MAX_CELL else text[:MAX_CELL] + " ..."  # the JSON keeps it whole


def failed(row: dict, error: BaseException, prefix: str = "") -> dict:
    """`row` as a failed row carrying the error message (and the traceback, in the JSON only)."""
    message = f"{prefix}{type(error).__name__}: {error}"
    return {**row, "status": "fail", "note": message, "traceback": "".join(traceback.format_exception(error))}


def judged(row: dict, errors: Dict[str, float], tolerance: float) -> dict:
    """`row` with its errors, passing when every error is within tolerance (NaN fails)."""
    ok = all(e <= tolerance for e in errors.values())
    return {**row, "errors": errors, "tolerance": tolerance, "status": "pass" if ok else "fail"}


def measured(row: dict, measure: Callable[[], Dict[str, float]], tolerance: float) -> dict:
    """The judged row of measure(), or the failed row of its exception."""
    try:
        return judged(row, measure(), tolerance)
    except Exception as e:
        return failed(row, e)
