"""The GPU check's sizes, tolerances and set-up (docs/gpu.md says why each tolerance is what it is)."""

import dataclasses
from pathlib import Path
from typing import Optional, Tuple

import torch

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

