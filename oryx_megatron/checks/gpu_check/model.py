"""Section b of the GPU check: Oryx-TG and Oryx-TM built twice on the same weights, kernel_backend
"auto" (the CUDA kernels where they may run) and "torch": the logits of one parallel forward, and
prefill + cached decode against the parallel forward, per schedule."""

import dataclasses
import functools
from typing import TYPE_CHECKING, Callable, List, Tuple

import torch

from oryx_megatron import ops
from oryx_megatron.checks.gpu_check.report import Report, failed, measured
from oryx_megatron.checks.gpu_check.setup import DECODE_SCHEDULES, MODEL_FAMILIES, MODEL_RTOL, Setup
from oryx_megatron.ops.probe import rel_err

if TYPE_CHECKING:  # megatron is imported when the section runs, after the warning filters
    from oryx_megatron.config import ModelArgs


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


def model_rows() -> int:
    """Rows of the section when nothing goes wrong."""
    return len(MODEL_FAMILIES) * len(model_checks())


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
