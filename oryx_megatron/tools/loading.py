"""What the command-line tools share: a checkpoint loaded for inference, and its dataset's tokenizer.

Used by ``oryx-generate``, ``oryx-eval`` and the lm-eval-harness entry (``tools.lm_eval_harness``).
The tokenizers live in ``data_prep``, which only the tools layer may import; the library below
(``inference``, ``eval``) takes a loaded model and tokenizer.
"""

import argparse
import os
from pathlib import Path
from typing import Optional, Tuple

import torch

from data_prep.tokenizer import EOD_TOKEN, AnyTokenizer, load_tokenizer
from oryx_megatron.data.loader import parse_blend
from oryx_megatron.data.shards import Manifest
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.run_config import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HF_NEEDS = "needs transformers and safetensors: pip install 'oryx-megatron[hf]'"  # oryx-export / oryx-import


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str) -> str:
    """bf16 on a GPU, fp32 on the CPU."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_for_inference(checkpoint: str, device: Optional[str] = None, dtype: Optional[str] = None):
    """(model on ``device`` (default ``default_device()``) in ``dtype`` (a name of DTYPES, default
    ``default_dtype``), in eval mode; the run's config)."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of {', '.join(DTYPES)}")
    model, run = load_model(checkpoint, DTYPES[dtype])
    return model.to(device), run


def hf_format_parser(prog: str, doc: str) -> Tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """(the parser of ``prog FORMAT ...``, its one format's subparser ``hf``): oryx-export's and oryx-import's."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    return parser, formats.add_parser("hf", help="a transformers model folder")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """CHECKPOINT, --device and --dtype."""
    parser.add_argument("checkpoint", help="a checkpoint dir (iter_NNNNNNN) or a run's checkpoint.dir (uses 'latest')")
    parser.add_argument("--device", default=default_device(), help="default: cuda where available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")


def load_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(model on args.device, run config); a bad checkpoint path is a parser error naming it."""
    if not Path(args.checkpoint).is_dir():
        parser.error(f"checkpoint {args.checkpoint}: no such directory")
    try:
        return load_for_inference(args.checkpoint, args.device, args.dtype)
    except FileNotFoundError as e:  # no checkpoint there, or a damaged one (CheckpointError names the file)
        parser.error(f"checkpoint {e}")
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # a corrupt or foreign checkpoint
        if os.environ.get("ORYX_DEBUG", "") not in ("", "0"):
            raise
        parser.error(f"checkpoint {args.checkpoint}: cannot load it: {_one_line(e)}")


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


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
