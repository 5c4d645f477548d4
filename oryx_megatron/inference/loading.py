"""A checkpoint loaded for inference, and its dataset's tokenizer: what ``oryx-generate``, ``oryx-eval``,
``oryx-export`` and the lm-eval-harness model (``eval.lm_eval_harness``) start from."""

from typing import Optional

import torch

from oryx_megatron.data.loader import parse_blend
from oryx_megatron.data.shards import Manifest
from oryx_megatron.data_prep.tokenizer import EOD_TOKEN, AnyTokenizer, load_tokenizer
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.run_config import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """bf16 on a GPU, fp32 on the CPU."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_for_inference(checkpoint: str, device: Optional[str] = None, dtype: Optional[str] = None,
                       context_parallel_size: int = 1):
    """(model on ``device`` (default ``default_device()``) in ``dtype`` (a name of DTYPES, default
    ``default_dtype``), in eval mode, its forwards split over ``context_parallel_size`` processes; the run's
    config)."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    model, run = load_model(checkpoint, DTYPES[dtype], context_parallel_size)
    return model.to(device), run


def dataset_tokenizer(run: TrainConfig, spec: Optional[str]) -> AnyTokenizer:
    """``spec`` ("byte" or a tokenizer.json), else the tokenizer recorded in the dataset's manifest."""
    if spec is None:
        if run.data.format == "indexed":
            raise ValueError("the checkpoint's dataset is a Megatron indexed dataset (no manifest): pass --tokenizer")
        manifest = Manifest.read(parse_blend(run.data.data_path)[0][0])
        info = manifest.tokenizer
        spec = "byte" if info["kind"] == "byte" else str(manifest.root / info["file"])
        return load_tokenizer(spec, info.get("eod_token") or EOD_TOKEN)
    return load_tokenizer(spec)
