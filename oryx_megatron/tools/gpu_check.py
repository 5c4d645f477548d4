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
  d. performance  tokens/s, MFU and peak memory of section c's runs.

Results go to --out as they come: report.json (rewritten after every row) and report.md. Each
row passes, fails or is skipped (a CUDA kernel that cannot run here); a section that raises
becomes a failed row with the message. Exit code 0 only when no row failed.

Without CUDA the command is a dry run at --toy sizes, labelled "CPU dry run: nothing here ran on
a GPU": the CUDA wrappers fall back to the torch ops on CPU tensors, so the kernel and model
comparisons compare torch with itself through the dispatch (the rows say so). It exists so that
the test suite runs the code of every section.
"""

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.metadata
import importlib.util
import math
import shutil
import statistics
import subprocess
import sys
import time
import traceback
import warnings
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from tqdm import tqdm

from oryx_megatron import ops
from oryx_megatron.ops import cuda, selection
from oryx_megatron.eval.reporting import write_json

if TYPE_CHECKING:  # megatron is imported when a section needs it, after the warning filters
    from oryx_megatron.models.builder import ModelArgs

DRY_RUN_LABEL = "CPU dry run: nothing here ran on a GPU"
TRAIN_FAMILIES = ("transformer", "mamba2", "gdn", "oryx_tm", "oryx_tg")
MODEL_FAMILIES = ("oryx_tg", "oryx_tm")
DECODE_SCHEDULES = ("all_linear", "all_attention", "prefill=linear decode=attention")

# Tolerances (docs/gpu.md). Relative error of a tensor: max |x - ref| / max |ref|.
KERNEL_RTOL = 2e-2  # bf16 kernels vs fp64: 0.15-0.7% measured on an H200 (gpu-device notes), ~3x margin
MODEL_RTOL = {torch.bfloat16: 1e-1, torch.float32: 1e-2}  # logits; bf16 alone drifts up to 4.4%, fp32 Triton
# kernels multiply in TF32 (tl.dot's default: ~1e-3 on logits); the torch ops agree to 3e-7 (docs/gpu.md)
RESUME_ATOL = {"cpu": 0.0, "cuda": 2e-2}  # loss; CPU fp32 is exact, GPU backward kernels use atomics
RESUME_FLOOR_FACTOR = 4  # the resumed curve may also differ by 4x the run-to-run floor (diff_before_resume)
PERF_SKIP = 2  # first steps left out of the throughput medians (compile, autotune, allocator warm-up)

ACT, GATE = torch.bfloat16, torch.float32  # activations bf16; gates and recurrent states fp32, as the layers pass them
CONV_WIDTH = 4
SEQUENCE_OPS = ("causal_conv1d", "chunk_gated_delta_rule", "ssd_chunk_scan", "causal_attention",
                "block_sparse_causal_attention", "gated_rms_norm")  # with a backward
SPARSE_BLOCK = cuda.FLEX_BLOCK_SIZE  # query block of block_sparse_causal_attention; every other block reads
OUTPUT_NAMES = {
    "causal_conv1d": ("y", "final_state"),
    "causal_conv1d_step": ("y", "new_state"),
    "chunk_gated_delta_rule": ("o", "final_state"),
    "gated_delta_rule_step": ("o", "new_state"),
    "ssd_chunk_scan": ("y", "final_state"),
    "ssd_step": ("y", "new_state"),
    "causal_attention": ("o",),
    "block_sparse_causal_attention": ("o",),
    "gated_rms_norm": ("o",),
}
VERSIONS = {  # report name -> (distributions, module)
    "torch": (("torch",), "torch"),
    "triton": (("triton",), "triton"),
    "megatron-core": (("megatron-core",), "megatron.core"),
    "fla": (("flash-linear-attention", "fla-core"), "fla"),
    "mamba-ssm": (("mamba-ssm",), "mamba_ssm"),
    "causal-conv1d": (("causal-conv1d",), "causal_conv1d"),
    "transformer-engine": (("transformer-engine", "transformer_engine"), "transformer_engine"),
    "tilelang": (("tilelang",), "tilelang"),  # fla's GDN backward on Hopper without Triton >= 3.7.1
}
MAX_CELL = 400  # characters of a markdown cell
NOISE = ("Apex is not installed", "Transformer Engine and Apex are not installed", "full scope is deprecated")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Every size of the check; --toy shrinks them all."""

    kernel_shape: Tuple[int, int, int, int]  # b, s, h, d of the kernel inputs
    model: str  # recipes/model/<model>.yaml, {family} filled in
    model_overrides: Tuple[Tuple[str, int], ...]  # ModelArgs fields replaced
    logits_shape: Tuple[int, int]  # b, s of the cuda-vs-torch forward
    mode_chunk: int  # random_chunks modes of that forward
    prompt_lengths: Tuple[int, ...]  # ragged prompts of the decode check
    max_new_tokens: int
    train_model: str  # the model override of the training runs, {family} filled in
    seq_length: int
    train_iters: int  # the resume run stops after half of them
    micro_batch_size: int
    global_batch_size: int
    mqar_vocab_size: int  # answers are ids of its upper half: the loss falls within a few steps
    mqar_num_pairs: int  # = answers per sample, the tokens the loss is taken on
    lr: Optional[float]  # None: the recipe's
    bf16: bool


FULL = Sizes(  # the 130M recipes on one H100/H200
    kernel_shape=(2, 512, 8, 64), model="{family}_130m", model_overrides=(), logits_shape=(2, 2048), mode_chunk=128,
    prompt_lengths=(192, 200), max_new_tokens=8, train_model="recipe={family}_130m", seq_length=2048,
    train_iters=20, micro_batch_size=8, global_batch_size=8, mqar_vocab_size=8192, mqar_num_pairs=64, lr=None,
    bf16=True,
)
TOY = Sizes(  # seconds on a CPU
    kernel_shape=(2, 40, 2, 16), model="tiny_{family}", model_overrides=(("num_layers", 2), ("linear_chunk_size", 16)),
    logits_shape=(2, 64), mode_chunk=16, prompt_lengths=(20, 27), max_new_tokens=4, train_model="model=tiny_{family}",
    seq_length=64, train_iters=8, micro_batch_size=2, global_batch_size=2, mqar_vocab_size=64, mqar_num_pairs=8,
    lr=1e-2, bf16=False,
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where the check runs and at which sizes."""

    device: torch.device
    sizes: Sizes
    out: Path
    families: Tuple[str, ...]

    @property
    def dry_run(self) -> bool:
        return self.device.type != "cuda"

    @property
    def model_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.sizes.bf16 else torch.float32


# ---- the report ----

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
    "performance": "d. performance: from section c's uninterrupted runs (medians after the first steps)",
}


class Report:
    """Rows by section, rewritten to report.json and report.md after every row."""

    def __init__(self, out: Path, header: dict):
        self.out = out
        self.out.mkdir(parents=True, exist_ok=True)
        self.data = {"header": header, "sections": {}, "summary": {}}
        self.bar: Optional[tqdm] = None
        self.name, self.rows = None, None  # the section being run

    @contextmanager
    def section(self, name: str, total: int):
        """Rows added inside belong to `name`; an exception becomes a failed row and ends the section."""
        entry = self.data["sections"][name] = {"status": "running", "rows": [], "seconds": None}
        self.name, self.rows, start = name, entry["rows"], time.perf_counter()
        self.bar = tqdm(total=total, desc=f"{name:<11}", unit="check", file=sys.stderr, dynamic_ncols=True)
        self.write()
        try:
            yield
            entry["status"] = "done"
        except Exception as e:
            self.add(failed({}, e, prefix=f"section {name} raised "))
            entry["status"] = "done"
        finally:  # also on Ctrl-C: what ran stays in the report, the section marked "running"
            entry["seconds"] = round(time.perf_counter() - start, 2)
            self.bar.close()
            self.write()

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.bar.update(1)
        cells = [f"{key}={_cell(row[key])}" for key in SECTION_COLUMNS[self.name][:-2] if key in row]
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
    facts = {k: header[k] for k in ("date", "device", "compute_capability", "nvcc", "toy", "command", "git_commit",
                                    "python")}
    lines += _table(("", ""), [(k, v) for k, v in facts.items()])
    lines += ["", "## Versions", ""] + _table(("package", "version"), header["versions"].items())
    lines += ["", '## Kernels chosen by get_kernels("auto")', ""] + _table(("op", "implementation"),
                                                                         header["kernels_auto"].items())
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


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| in fp64 (the absolute error when ref is all zeros)."""
    diff = (x.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return diff / scale if scale else diff


# ---- the header ----

def package_version(distributions: Sequence[str], module: str) -> str:
    """The installed version, or one read from a source tree on the path (no metadata), or "not installed"."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
        version = getattr(importlib.import_module(module), "__version__", "unknown")
        return f"{version} (source tree, no package metadata)"
    except Exception as e:  # a half-installed package raises more than ImportError
        return f"not importable: {type(e).__name__}: {e}"


def source_version(commit: Optional[str]) -> Optional[str]:
    """The commit, marked when the working tree differs from it."""
    try:
        diff = subprocess.run(["git", "diff", "--quiet", "HEAD"], cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return commit
    return f"{commit} + uncommitted changes" if commit and diff.returncode == 1 else commit


def make_header(setup: Setup, argv: Sequence[str]) -> dict:
    from oryx_megatron.training.metrics import git_commit

    try:
        chosen = ops.get_kernels("auto").names
    except Exception as e:  # a bad $ORYX_KERNEL_BACKEND
        chosen = {"error": f"{type(e).__name__}: {e}"}
    env = selection.KernelEnvironment.detect()
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(setup.device) if not setup.dry_run else "CPU (dry run)",
        "dry_run": setup.dry_run,
        "label": DRY_RUN_LABEL if setup.dry_run else "GPU run",
        "toy": setup.sizes == TOY,
        "command": " ".join(["oryx-gpu-check", *argv]),
        "git_commit": source_version(git_commit()),
        "python": sys.version.split()[0],
        "compute_capability": ".".join(map(str, env.capability)) if env.capability else None,
        "nvcc": env.nvcc,
        # torch.__version__ keeps the build's local tag (2.11.0+cu130) that the metadata of PyPI's wheels lacks
        "versions": {name: torch.__version__ if name == "torch" else package_version(*where)
                     for name, where in VERSIONS.items()},
        "kernels_auto": chosen,
        "sizes": dataclasses.asdict(setup.sizes),
        "tolerances": {"kernel_rel": KERNEL_RTOL, "model_rel": {str(k): v for k, v in MODEL_RTOL.items()},
                       "resume_abs": RESUME_ATOL, "resume_floor_factor": RESUME_FLOOR_FACTOR},
    }


# ---- a. kernels ----

def kernel_cases() -> List[Tuple[str, str]]:
    """(op, state case) for every call checked."""
    cases = []
    for op in ops.OPS:
        if op == "causal_attention":
            cases.append((op, "causal"))
        elif op == "block_sparse_causal_attention":
            cases.append((op, f"every other block of {SPARSE_BLOCK} reads"))
        elif op == "gated_rms_norm":
            cases.append((op, "per head"))
        elif op in SEQUENCE_OPS:
            cases += [(op, "no initial state"), (op, "initial state")]
        else:
            cases.append((op, "step"))
    return cases


def kernel_inputs(op: str, shape: Tuple[int, int, int, int], with_state: bool,
                  gen: torch.Generator) -> Dict[str, Tuple[torch.Tensor, torch.dtype]]:
    """Keyword arguments of one call of `op`: name -> (fp64 values, the dtype the kernel gets)."""
    b, s, h, d = shape
    step = op not in SEQUENCE_OPS
    seq = () if step else (s,)  # step ops take one token: no sequence axis

    def rand(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    state_name = "state" if step else "initial_state"
    if op.startswith("causal_conv1d"):
        c = h * d
        args = {"x": (rand(b, *seq, c), ACT), "weight": (rand(c, CONV_WIDTH) / 2, ACT), "bias": (rand(c), ACT)}
        state = (rand(b, c, CONV_WIDTH - 1), ACT)  # [b, c, w - 1], the previous inputs
    elif op in ("chunk_gated_delta_rule", "gated_delta_rule_step"):
        args = {name: (F.normalize(rand(b, *seq, h, d), dim=-1), ACT) for name in ("q", "k")}  # [b, (s,) h, d_k]
        args.update(v=(rand(b, *seq, h, d), ACT),  # [b, (s,) h, d_v]
                    g=(F.logsigmoid(rand(b, *seq, h)), GATE), beta=(rand(b, *seq, h).sigmoid(), GATE))  # [b, (s,) h]
        state = (rand(b, h, d, d), GATE)  # [b, h, d_k, d_v]
    elif op in ("ssd_chunk_scan", "ssd_step"):
        args = {"x": (rand(b, *seq, h, d), ACT),  # [b, (s,) h, p]
                "dt": (F.softplus(rand(b, *seq, h) - 2), GATE),  # [b, (s,) h], > 0
                "A": (-(rand(h) / 2).exp(), GATE),  # [h], < 0
                "B": (rand(b, *seq, h, d), ACT), "C": (rand(b, *seq, h, d), ACT),  # [b, (s,) h, n]
                "D": (rand(h), GATE)}  # [h], a parameter the model keeps in fp32
        state = (rand(b, h, d, d) / 4, GATE)  # [b, h, n, p]
    elif op == "gated_rms_norm":
        return {"y": (rand(b, s, h, d), ACT), "gate": (rand(b, s, h, d), ACT),  # [b, s, h, d_v]
                "weight": (1 + rand(h * d) / 10, ACT)}  # [h * d_v], a parameter of the model
    else:  # causal_attention, block_sparse_causal_attention
        args = {name: (rand(b, s, h, d), ACT) for name in ("q", "k", "v")}  # [b, s, h, d]
        if op == "block_sparse_causal_attention":
            read = (torch.arange(s) // SPARSE_BLOCK % 2 == 0).expand(b, s).clone()  # [b, s]
            args.update(read=(read, torch.bool), block_size=SPARSE_BLOCK)
        return args
    if with_state or step:
        args[state_name] = state
    return args


class KernelCall:
    """One op on one set of inputs, through the CUDA wrapper and as the torch op in fp64 (run on
    first use, so that a failure lands in the row that asked)."""

    def __init__(self, op: str, case: str, setup: Setup):
        self.op, self.case, self.setup = op, case, setup
        self._run = None  # (inputs, ref_inputs, outputs, ref_outputs)

    def run(self):
        if self._run is None:
            op, grad = self.op, self.op in SEQUENCE_OPS
            gen = torch.Generator().manual_seed(zlib.crc32(f"{op}/{self.case}".encode()))
            values = kernel_inputs(op, self.setup.sizes.kernel_shape, self.case == "initial state", gen)
            inputs = {n: _on(value, self.setup.device, grad) for n, value in values.items()}
            ref_inputs = {n: _on((t, torch.float64), self.setup.device, grad) if _differentiable(t) else t
                          for n, t in inputs.items()}  # same values
            got, want = getattr(cuda, op)(**inputs), ops.TORCH_OPS[op](**ref_inputs)
            self._run = (inputs, ref_inputs, *(t if isinstance(t, tuple) else (t,) for t in (got, want)))
        return self._run

    def forward_errors(self) -> Dict[str, float]:
        _, _, got, want = self.run()
        return {name: rel_err(x, ref) for name, x, ref in zip(OUTPUT_NAMES[self.op], got, want)}

    def backward_errors(self) -> Dict[str, float]:
        """Gradients of sum(w * output) over outputs and states, w random, w.r.t. every input."""
        inputs, ref_inputs, got, want = self.run()
        gen = torch.Generator().manual_seed(1)
        weights = [torch.randn(ref.shape, generator=gen, dtype=torch.float64).to(ref.device) for ref in want]
        grads, ref_grads = _grads(got, weights, inputs), _grads(want, weights, ref_inputs)
        return {f"d{name}": rel_err(grads[name], ref) if grads[name] is not None else math.inf
                for name, ref in ref_grads.items()}


def _differentiable(x) -> bool:
    return torch.is_tensor(x) and x.is_floating_point()


def _on(value, device, grad: bool):
    """A kernel argument: (fp64 values, dtype) -> a tensor on ``device`` (a leaf requiring grad when
    ``grad`` and floating); other arguments (block sizes) as they are."""
    if not isinstance(value, tuple):
        return value
    tensor, dtype = value
    tensor = tensor.detach().to(device, dtype)
    return tensor.requires_grad_(grad) if tensor.is_floating_point() else tensor


def _grads(outputs, weights, leaves: Dict[str, torch.Tensor]) -> Dict[str, Optional[torch.Tensor]]:
    leaves = {name: t for name, t in leaves.items() if _differentiable(t)}
    loss = sum((t.double() * w).sum() for t, w in zip(outputs, weights))
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))


def check_kernels(setup: Setup, report: Report) -> None:
    env, auto = selection.KernelEnvironment.detect(), ops.get_kernels("auto").names
    for op, case in kernel_cases():
        call = KernelCall(op, case, setup)
        measures = {"fwd": call.forward_errors}
        if op in SEQUENCE_OPS:
            measures["bwd"] = call.backward_errors
        kernel = "torch" if setup.dry_run else selection.IMPLEMENTATIONS[op][0]
        base = {"op": op, "implementation": kernel, "note": _kernel_note(kernel, auto[op], setup)}
        for direction, measure in measures.items():
            row = {**base, "case": f"{direction}, {case}"}
            refusal = None if setup.dry_run else selection.refusal(op, env, backward=direction == "bwd")
            if refusal:
                report.add({**row, "status": "skipped", "note": f"skipped: {refusal}"})
            else:
                report.add(measured(row, measure, KERNEL_RTOL))


def _kernel_note(kernel: str, auto: str, setup: Setup) -> str:
    if setup.dry_run:
        return "dry run: the CUDA wrapper ran the torch op (CPU tensors) vs the fp64 torch op"
    if auto != kernel:
        return f'get_kernels("auto") picks {auto} instead (its one-time check, or ${ops.BACKEND_ENV_VAR})'
    return ""


# ---- b. model ----

@dataclasses.dataclass
class ModelPair:
    """One recipe built twice on the same weights: kernel_backend "auto" (CUDA where it runs) and "torch"."""

    args: "ModelArgs"
    model: torch.nn.Module
    reference: torch.nn.Module


def build_pair(family: str, setup: Setup) -> ModelPair:
    from oryx_megatron.models.builder import build_model, transformer_config
    from oryx_megatron.models.params import load_model_args

    s, dtype = setup.sizes, setup.model_dtype
    args = dataclasses.replace(load_model_args([f"model={s.model.format(family=family)}"]), **dict(s.model_overrides))
    models = {}
    for backend in ("torch", "auto"):
        backend_args = dataclasses.replace(args, kernel_backend=backend)
        torch.manual_seed(0)
        model = build_model(backend_args, transformer_config(backend_args, params_dtype=dtype,
                                                             bf16=dtype == torch.bfloat16))
        models[backend] = model.to(setup.device).eval()  # built in dtype (SSM scalars fp32): moved, not cast
    models["auto"].load_state_dict(models["torch"].state_dict())
    return ModelPair(args, models["auto"], models["torch"])


def model_checks() -> List[Tuple[str, str, Callable[[ModelPair, Setup], float]]]:
    """(check, backends compared, its error) of section b."""
    checks = [("parallel logits", "auto vs torch", logits_error)]
    return checks + [(f"decode vs parallel: {schedule}", "auto", functools.partial(decode_error, schedule=schedule))
                     for schedule in DECODE_SCHEDULES]


def check_model(setup: Setup, report: Report) -> None:
    from oryx_megatron.parallel import initialize_parallel

    initialize_parallel()
    tolerance = MODEL_RTOL[setup.model_dtype]
    fallbacks = [op for op, name in ops.get_kernels("auto").names.items() if name == "torch"]
    note = ("dry run: 'auto' picked the torch ops: torch compared with itself" if setup.dry_run
            else f"auto fell back to torch for: {', '.join(fallbacks)}" if fallbacks else "")
    for family in MODEL_FAMILIES:
        try:
            pair = build_pair(family, setup)
        except Exception as e:
            pair = e
        for check, backends, error in model_checks():
            row = {"family": family, "check": check, "backends": backends, "note": note}
            if isinstance(pair, Exception):
                report.add(failed(row, pair))
            else:
                report.add(measured(row, lambda: {"logits": error(pair, setup)}, tolerance))
        pair = None  # free the two models before the next family


@torch.no_grad()
def logits_error(pair: ModelPair, setup: Setup) -> float:
    """Logits of one parallel forward with random tokens and random chunks of modes."""
    from oryx_megatron.data.modes import RandomChunks

    b, s = setup.sizes.logits_shape
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, pair.args.vocab_size, (b, s), generator=gen).to(setup.device)  # [b, s]
    modes = RandomChunks(setup.sizes.mode_chunk).batch(s, range(b)).to(setup.device)  # [b, s] int8
    return rel_err(pair.model(ids, modes), pair.reference(ids, modes))  # logits [b, s, vocab]


@torch.no_grad()
def decode_error(pair: ModelPair, setup: Setup, schedule: str) -> float:
    """Logits of generate() (prefill, then one cached token at a time) vs one parallel forward
    over each prompt and its generated tokens; the "auto" model."""
    from oryx_megatron.inference import generate, parse_schedule

    s, model, vocab = setup.sizes, pair.model, pair.args.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in s.prompt_lengths]
    result = generate(model, prompts, schedule, s.max_new_tokens, vocab_size=vocab, output_logits=True)
    errors = []
    for prompt, new, logits in zip(prompts, result.tokens, result.logits):  # logits [len(new), vocab]
        total = len(prompt) + len(new) - 1  # positions fed
        modes = torch.from_numpy(parse_schedule(schedule).position_modes(len(prompt), total))  # [total]
        ids = torch.tensor([prompt + new[:-1]])  # [1, total]
        parallel = model(ids.to(setup.device), modes[None].to(setup.device))[0, len(prompt) - 1:]
        errors.append(rel_err(logits, parallel))
    return max(errors)


# ---- c. training ----

def train_overrides(family: str, sizes: Sizes) -> List[str]:
    """oryx-train overrides of the check's runs of `family` (checkpointing aside)."""
    overrides = [sizes.train_model.format(family=family), "data=mqar", f"data.seq_length={sizes.seq_length}",
                 f"data.mqar_vocab_size={sizes.mqar_vocab_size}", f"data.mqar_num_pairs={sizes.mqar_num_pairs}",
                 f"train.train_iters={sizes.train_iters}",
                 "train.train_tokens=null", f"train.micro_batch_size={sizes.micro_batch_size}",
                 f"train.global_batch_size={sizes.global_batch_size}", "train.log_interval=1",
                 "train.eval_interval=null", f"train.bf16={str(sizes.bf16).lower()}",
                 "optimizer.lr_warmup_iters=2", "logging.wandb_mode=disabled"]
    return overrides + ([f"optimizer.lr={sizes.lr}"] if sizes.lr is not None else [])


def train(overrides: List[str], output_dir: Path) -> List[float]:
    """pretrain() of the composed config; the train/loss of every step it logged."""
    from hydra import compose, initialize_config_dir

    from oryx_megatron import RECIPES_DIR
    from oryx_megatron.training.loop import pretrain
    from oryx_megatron.training.config import load_train_config

    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        run = load_train_config(compose("train", overrides=overrides))
    if torch.cuda.is_available():  # perf/memory_gb is the peak since the last reset: this run's
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    code = pretrain(run, str(output_dir))
    if code != 0:
        raise RuntimeError(f"pretrain returned {code}")
    return [row["train/loss"] for row in metrics(output_dir) if "train/loss" in row]


def metrics(output_dir: Path) -> List[dict]:
    from oryx_megatron.training.metrics import read_rows

    return read_rows(output_dir / "metrics.jsonl")


def check_training(setup: Setup, report: Report) -> None:
    s = setup.sizes
    for family in setup.families:
        row = {"family": family, "iterations": s.train_iters}
        try:
            row.update(train_family(family, setup))
            # the run-to-run floor: the first half ran the same steps twice (non-deterministic GPU atomics)
            row["tolerance"] = max(RESUME_ATOL[setup.device.type], RESUME_FLOOR_FACTOR * row["diff_before_resume"])
            ok = row["finite"] and row["falling"] and row["resume_max_abs_diff"] <= row["tolerance"]
            report.add({**row, "status": "pass" if ok else "fail"})
        except Exception as e:
            report.add(failed(row, e))


def train_family(family: str, setup: Setup) -> dict:
    """The uninterrupted run, then the same run stopped half-way and resumed; their loss curves."""
    s, root = setup.sizes, setup.out / "training" / family
    shutil.rmtree(root, ignore_errors=True)  # metrics.jsonl appends, and a checkpoint would be resumed
    overrides = train_overrides(family, s)
    straight = train([*overrides, "checkpoint.dir=null", "checkpoint.save_at_end=false"], root / "straight")
    split = [*overrides, f"checkpoint.dir={root / 'ckpt'}", f"train.exit_interval={s.train_iters // 2}",
             "checkpoint.save_at_end=true"]
    first = train(split, root / "first")  # stops at exit_interval, saving a checkpoint
    second = train(split, root / "second")  # resumes from it
    shutil.rmtree(root / "ckpt")  # 2 GB at 130M
    if len(first) + len(second) != len(straight) or len(straight) != s.train_iters:
        raise RuntimeError(f"logged {len(first)} + {len(second)} steps resumed, {len(straight)} straight, "
                           f"expected {s.train_iters}")
    half = len(first)
    return {
        "loss_first": straight[0], "loss_last": straight[-1],
        "finite": all(math.isfinite(x) for x in straight + first + second),
        "falling": straight[-1] < straight[0],
        "resume_max_abs_diff": max(abs(a - b) for a, b in zip(second, straight[half:])),
        "diff_before_resume": max(abs(a - b) for a, b in zip(first, straight[:half])),
    }


# ---- d. performance ----

def check_performance(setup: Setup, report: Report) -> None:
    note = "dry run: CPU numbers (memory: peak RSS), not a GPU measurement" if setup.dry_run else ""
    for family in setup.families:
        row = {"family": family, "note": note}
        try:
            row.update(performance(setup.out / "training" / family / "straight"))
            ok = all(math.isfinite(row[k]) and row[k] > 0 for k in ("tokens_per_s", "mfu", "memory_gb"))
            report.add({**row, "status": "pass" if ok else "fail"})
        except Exception as e:
            report.add(failed(row, e, prefix="no training metrics (section c): "))


def performance(output_dir: Path) -> dict:
    steps = [row for row in metrics(output_dir) if "perf/tokens_per_s" in row]
    timed = steps[PERF_SKIP:] or steps
    return {
        "tokens_per_s": statistics.median(row["perf/tokens_per_s"] for row in timed),
        "mfu": statistics.median(row["perf/mfu"] for row in timed),
        "memory_gb": max(row["perf/memory_gb"] for row in steps),
    }


# ---- the command ----

SECTIONS: Dict[str, Callable[[Setup, Report], None]] = {
    "kernels": check_kernels,
    "model": check_model,
    "training": check_training,
    "performance": check_performance,
}


def section_size(name: str, setup: Setup) -> int:
    """Rows the section adds when nothing goes wrong (the progress bar's total)."""
    if name == "kernels":
        return sum(2 if op in SEQUENCE_OPS else 1 for op, _ in kernel_cases())
    if name == "model":
        return len(MODEL_FAMILIES) * (1 + len(DECODE_SCHEDULES))
    return len(setup.families)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="oryx-gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/gpu_check"), help="report.json, report.md, runs")
    parser.add_argument("--toy", action="store_true", help="toy sizes everywhere (implied without CUDA)")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--families", nargs="+", default=list(TRAIN_FAMILIES),
                        help="model families of sections c and d")
    return parser.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    for message in NOISE:
        warnings.filterwarnings("ignore", message=f".*{message}.*")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    toy = args.toy or device.type != "cuda"
    setup = Setup(device, TOY if toy else FULL, args.out, tuple(args.families))
    if setup.dry_run:
        print(f"{DRY_RUN_LABEL} (no CUDA): toy sizes, CUDA wrappers fall back to torch", file=sys.stderr)
    report = Report(args.out, make_header(setup, argv))
    for name in [name for name in SECTIONS if name in args.sections]:  # c before d, whatever the order given
        with report.section(name, section_size(name, setup)):
            SECTIONS[name](setup, report)
    summary = report.data["summary"]
    print(f"{summary['pass']} passed, {summary['fail']} failed, {summary['skipped']} skipped: "
          f"{args.out / 'report.md'}")
    return report.exit_code()


if __name__ == "__main__":
    sys.exit(main())
