"""What the GPU session brings back, flat, in --out (the device tool returns at most 8 files):

  results.json  the header (date, device, Python, source commit, versions), the plan (deadline, caps,
                the environment every stage shares), the kernel probes' verdicts, and per stage its
                command, exit code, seconds, limit and its own JSON: rewritten as rows arrive
  session.log   one line per probe summary and per stage start and end
  logs.tar.gz   every stage's and probe's console output and the GPU check's report.md files
"""

import datetime
import json
import sys
import tarfile
from pathlib import Path
from typing import Optional

from oryx_megatron.checks import provenance
from oryx_megatron.eval.reporting import write_json

OUT_FILES = ("results.json", "session.log", "logs.tar.gz")


def header(toy: bool) -> dict:
    import torch

    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (rehearsal)",
        "toy": toy,
        "python": sys.version.split()[0],
        "source": provenance.source(),
        "versions": provenance.versions(),
    }


def read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written (yet), or cut off
        return None


class Outputs:
    """results.json, session.log and logs.tar.gz in ``out``, each replaced whole (a reader never sees
    half a file)."""

    def __init__(self, out: Path, work: Path, results: dict):
        self.out, self.work, self.results = out, work, results
        out.mkdir(parents=True, exist_ok=True)
        (out / "session.log").write_text("")
        self.write_results()

    def write_results(self) -> None:
        write_json(self.out / "results.json", self.results)

    def fold(self, stage: str, result: Path) -> None:
        """The stage's own JSON as it is now into results.json, when it changed."""
        found = read_json(result)
        entry = self.results["stages"][stage]
        if found is not None and found != entry["results"]:
            entry["results"] = found
            self.write_results()

    def write_logs(self) -> None:
        tmp = self.out / "logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(self.work.glob("*.log")) + sorted(self.work.glob("*/*.log")) + sorted(
                    self.work.glob("*/report.md")):
                tar.add(path, arcname=str(path.relative_to(self.work)))
        tmp.replace(self.out / "logs.tar.gz")

    def log(self, line: str) -> None:
        with open(self.out / "session.log", "a") as f:
            f.write(f"{datetime.datetime.now().strftime('%H:%M:%S')} {line}\n")
        print(line, file=sys.stderr, flush=True)
