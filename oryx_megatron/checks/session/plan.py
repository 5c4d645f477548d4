"""The GPU session's plan: the stages in order of value, each with its cap, and how the deadline is shared.

Every stage is guaranteed its cap: the caps (the kernel probes' included) add up to at most the deadline,
and a stage's time limit is what is left of the deadline less the caps of the stages still to come. A
stage that ends early leaves its time to the next ones, never takes theirs.
"""

import dataclasses
from typing import Dict, List, Sequence, Tuple

DEADLINE_S = {"full": 480, "toy": 1200}  # the whole session; the toy rehearsal runs on a loaded CPU
PROBES = "probes"  # the kernel probes' phase, before any stage
GRACE_S = 10  # between SIGTERM and SIGKILL (the training loop catches SIGTERM to save for requeue)
MIN_STAGE_S = 20  # a stage with a shorter limit is not started
CHECK = ("-m", "oryx_megatron.cli.gpu_check")
TRAIN_STEP = ("benchmarks/bench_train_step.py",)
INFERENCE = ("benchmarks/bench_inference.py",)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    cap_s: float  # the time it is guaranteed (a stage before it that ends early may leave it more)
    argv: Tuple[str, ...]  # after the python interpreter; {work} is filled in
    result: str  # the JSON file it writes (rewritten after every row), under the work folder


@dataclasses.dataclass(frozen=True)
class Sizes:
    check: Tuple[str, ...]  # the GPU check's size flag
    step: Tuple[str, ...]  # bench_train_step.py at 130M (toy: tiny)
    big: Tuple[str, ...]  # bench_train_step.py at 1.4B
    inference: Tuple[str, ...]  # bench_inference.py


FULL = Sizes(
    check=(),
    step=("--model-size", "130m", "--seq", "2048", "--micro-batch", "8", "--warmup", "2", "--repeats", "3"),
    big=("--model-size", "1_4b", "--seq", "2048", "--micro-batch", "2", "--warmup", "1", "--repeats", "2"),
    inference=("--model", "oryx_tg_130m", "--contexts", "1024", "16384", "--batches", "1", "64", "--new-tokens", "32",
               "--repeats", "1", "--cuda-graphs", "both"),
)
_TINY_STEP = ("--model-size", "tiny", "--layers", "1", "--seq", "64", "--micro-batch", "1", "--warmup", "1",
              "--repeats", "1")
TOY = Sizes(  # every stage and code path at the smallest sizes (seconds each, most of it imports); on CPU the
    # CUDA-graph rows fail (no CUDA) beside their eager rows
    check=("--toy",), step=_TINY_STEP, big=_TINY_STEP,
    inference=("--contexts", "32", "--batches", "1", "--new-tokens", "2", "--repeats", "1", "--cuda-graphs", "both"),
)
PROBES_CAP_S = 60  # every kernel probed at once, each in its own process (the first Triton compiles start here)


def stages(toy: bool) -> List[Stage]:
    """The stages in order of value: parity first (is anything wrong?), then megatron's training path
    with exact resume for the slowest Oryx family and the Transformer (the last GPU contact failed
    there), the 130M train-step rows, inference, then the rest if time is left."""
    s = TOY if toy else FULL
    families = (("oryx_tg",), ("transformer",)) if toy else (("oryx_tg", "transformer"), ("oryx_tm", "mamba2", "gdn"))
    return [
        Stage("parity", 140, (*CHECK, *s.check, "--sections", "kernels", "model", "--out", "{work}/parity"),
              "parity/report.json"),
        Stage("training", 90, (*CHECK, *s.check, "--sections", "training", "--families", *families[0],
                               "--out", "{work}/training"), "training/report.json"),
        Stage("train_step", 60, (*TRAIN_STEP, *s.step, "--p-attention", "0.5", "0.1", "--json", "{work}/train_step.json"),
              "train_step.json"),
        Stage("inference", 50, (*INFERENCE, *s.inference, "--speculative", "4", "--json", "{work}/inference.json"),
              "inference.json"),
        Stage("training_rest", 30, (*CHECK, *s.check, "--sections", "training", "--families", *families[1],
                                    "--out", "{work}/training_rest"), "training_rest/report.json"),
        Stage("train_reset", 25, (*TRAIN_STEP, *s.step, "--families", "oryx_tg", "oryx_tm", "--p-attention", "0.5",
                                  "--reset-at-eod", "--json", "{work}/train_reset.json"), "train_reset.json"),
        Stage("train_1_4b", 25, (*TRAIN_STEP, *s.big, "--families", "oryx_tg", "oryx_tm", "--p-attention", "0.5",
                                 "--recompute", "none", "selective", "--json", "{work}/train_1_4b.json"),
              "train_1_4b.json"),
    ]


def caps(selected: Sequence[Stage], deadline: float) -> Dict[str, float]:
    """Name -> cap of the probes and the selected stages, scaled down proportionally where they would
    add up to more than ``deadline`` (a rerun with --deadline in what is left of the machine)."""
    wanted = {PROBES: PROBES_CAP_S, **{stage.name: stage.cap_s for stage in selected}}
    scale = min(1.0, deadline / sum(wanted.values()))
    return {name: cap * scale for name, cap in wanted.items()}


def limit(name: str, left: float, caps_s: Dict[str, float]) -> float:
    """Seconds until SIGTERM for ``name`` with ``left`` seconds of the deadline left: what the caps of the
    steps after it do not claim, less the grace between SIGTERM and SIGKILL."""
    names = list(caps_s)
    later = sum(caps_s[n] for n in names[names.index(name) + 1:])
    return left - later - GRACE_S
