"""What several console scripts share: the checkpoint argument and its loading, the ``FORMAT`` parser of
oryx-export / oryx-import. Imported by cli modules only."""

import argparse
from pathlib import Path
from typing import Tuple

from oryx_megatron.checkpoint import CheckpointKeysError
from oryx_megatron.cli.errors import ArgumentParser, InputError, command_parser, one_line
from oryx_megatron.inference.loading import DTYPES, default_device, load_for_inference

HF_NEEDS = "needs transformers and safetensors: pip install 'oryx-megatron[hf]'"  # oryx-export / oryx-import


def hf_format_parser(prog: str, doc: str) -> Tuple[ArgumentParser, ArgumentParser]:
    """(the parser of ``prog FORMAT ...``, its one format's subparser ``hf``): oryx-export's and oryx-import's."""
    parser = command_parser(prog, doc)
    formats = parser.add_subparsers(dest="format", required=True, metavar="FORMAT")
    return parser, formats.add_parser("hf", help="a transformers model folder")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """CHECKPOINT, --device and --dtype."""
    parser.add_argument("checkpoint", help="a checkpoint dir (iter_NNNNNNN) or a run's checkpoint.dir (uses 'latest')")
    parser.add_argument("--device", default=default_device(), help="default: cuda where available, else cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on the CPU")


def load_checkpoint(args: argparse.Namespace):
    """(model on args.device, run config); a missing, damaged or foreign checkpoint is an InputError naming it."""
    if not Path(args.checkpoint).is_dir():
        raise InputError(f"checkpoint {args.checkpoint}: no such directory")
    try:
        return load_for_inference(args.checkpoint, args.device, args.dtype, getattr(args, "context_parallel", 1))
    except FileNotFoundError as e:  # no checkpoint there, or a damaged one (CheckpointError names the file)
        raise InputError(f"checkpoint {e}") from e
    except CheckpointKeysError as e:  # names the checkpoint and the keys the model does not have
        raise InputError(str(e)) from e
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # a corrupt or foreign checkpoint
        raise InputError(f"checkpoint {args.checkpoint}: cannot load it: {one_line(e)}") from e
