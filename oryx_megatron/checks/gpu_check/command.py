"""oryx-gpu-check: one command that checks the project on one GPU and writes what it found.

    oryx-gpu-check                      # meant to take <= 6 min on one H100/H200 (not yet timed there)
    oryx-gpu-check --toy --out /tmp/gc  # every section at toy sizes (seconds)
    make gpu-check                      # the same through the venv's python

Sections (docs/gpu.md says what each checks and why its tolerance is what it is):
  a. kernels      every CUDA kernel of ``oryx_megatron.ops.cuda`` against the torch op in fp64 on
                  the same bf16 inputs: outputs, states and, for the sequence ops, gradients;
  b. model        Oryx-TG / Oryx-TM logits with the CUDA kernels vs the torch kernels (same
                  weights), and prefill + cached decode vs the parallel forward;
  c. training     ``pretrain`` of every family on synthetic MQAR, then stop half-way, resume and
                  compare the loss curve with the uninterrupted run;
  d. performance  tokens/s, MFU and peak memory of section c's uninterrupted runs, each reported
                  as soon as its run ends (``--sections training`` writes both).

Results go to --out as they come: report.json and report.md, written first with the header alone
and rewritten after every row. Each row passes, fails or is skipped (a CUDA kernel that cannot run
here, or that this GPU session's probe refused: $ORYX_KERNEL_PROBES); a section that raises becomes a
failed row with the message. Exit code 0 only when no row failed.

Without CUDA the command is a dry run at --toy sizes, labelled "CPU dry run: nothing here ran on
a GPU": the CUDA wrappers fall back to the torch ops on CPU tensors, so the kernel and model
comparisons compare torch with itself through the dispatch (the rows say so). It exists so that
the test suite runs the code of every section.
"""

import argparse
import dataclasses
import datetime
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import torch

from oryx_megatron import ops
from oryx_megatron.checks import provenance
from oryx_megatron.checks.gpu_check.kernels import check_kernels, kernel_rows
from oryx_megatron.checks.gpu_check.model import check_model, model_rows
from oryx_megatron.checks.gpu_check.report import Report
from oryx_megatron.checks.gpu_check.setup import (
    DRY_RUN_LABEL, FULL, KERNEL_RTOL, MODEL_RTOL, RESUME_ATOL, RESUME_FLOOR_FACTOR, TOY, TRAIN_FAMILIES, Setup)
from oryx_megatron.checks.gpu_check.training import check_training
from oryx_megatron.ops import selection

NOISE = ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated")
SECTIONS: Dict[str, Callable[[Setup, Report], None]] = {  # training writes the performance rows too
    "kernels": check_kernels,
    "model": check_model,
    "training": check_training,
}


def make_header(setup: Setup, argv: Sequence[str]) -> dict:
    """Where and on what the check runs; the kernels get_kernels("auto") picks come later
    (``chosen_kernels``: it may probe every kernel)."""
    env = selection.KernelEnvironment.detect()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(setup.device) if not setup.dry_run else "CPU (dry run)",
        "dry_run": setup.dry_run,
        "label": DRY_RUN_LABEL if setup.dry_run else "GPU run",
        "toy": setup.sizes == TOY,
        "command": " ".join(["oryx-gpu-check", *argv]),
        "source": provenance.source(),
        "python": sys.version.split()[0],
        "compute_capability": ".".join(map(str, env.capability)) if env.capability else None,
        "nvcc": env.nvcc,
        "versions": provenance.versions(),
        "kernels_auto": None,
        "sizes": dataclasses.asdict(setup.sizes),
        "tolerances": {"kernel_rel": KERNEL_RTOL, "model_rel": {str(k): v for k, v in MODEL_RTOL.items()},
                       "resume_abs": RESUME_ATOL, "resume_floor_factor": RESUME_FLOOR_FACTOR},
    }


def chosen_kernels() -> Dict[str, str]:
    try:
        return ops.get_kernels("auto").names
    except Exception as e:  # a bad $ORYX_KERNEL_BACKEND or $ORYX_KERNEL_PROBES
        return {"error": f"{type(e).__name__}: {e}"}


def section_size(name: str, setup: Setup) -> int:
    """Rows the section adds when nothing goes wrong (the progress bar's total)."""
    if name == "kernels":
        return kernel_rows()
    if name == "model":
        return model_rows()
    return 2 * len(setup.families)  # a training and a performance row each


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oryx-gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/gpu_check", help="report.json, report.md, runs")
    parser.add_argument("--toy", action="store_true", help="toy sizes everywhere (implied without CUDA)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--families", nargs="+", default=list(TRAIN_FAMILIES),
                        help="model families of sections c and d, in this order")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for message in NOISE:
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    toy = args.toy or device.type != "cuda"
    setup = Setup(device, TOY if toy else FULL, Path(args.out), tuple(args.families))
    if setup.dry_run:
        print(f"{DRY_RUN_LABEL} (no CUDA): toy sizes, CUDA wrappers fall back to torch", file=sys.stderr)
    report = Report(setup.out, make_header(setup, argv))  # on disk before anything can crash
    report.data["header"]["kernels_auto"] = chosen_kernels()
    report.write()
    for name in [name for name in SECTIONS if name in args.sections]:  # in SECTIONS' order
        with report.section(name, section_size(name, setup)):
            SECTIONS[name](setup, report)
    summary = report.data["summary"]
    print(f"{summary['pass']} passed, {summary['fail']} failed, {summary['skipped']} skipped: "
          f"{setup.out / 'report.md'}")
    return report.exit_code()
