"""oryx-import: a Hugging Face transformers folder back to a megatron distributed checkpoint (docs/hf.md).

    oryx-import hf runs/demo/hf runs/finetuned/checkpoints --tp 2
    oryx-train checkpoint.dir=runs/finetuned/checkpoints ...   # continues from the folder's weights

The folder is one that oryx-export wrote (an Oryx model, or the Transformer as Llama), possibly fine-tuned
and saved again with save_pretrained. The checkpoint is iteration 0 of the folder's run (its metadata;
--set changes keys as oryx-train overrides do): the weights bit for bit, a fresh optimizer state, LR
schedule and data order. It needs the run's dataset (the loader's state is saved with it).
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.common import HF_NEEDS, hf_format_parser
from oryx_megatron.cli.errors import InputError, run_command


def build_parser() -> argparse.ArgumentParser:
    parser, hf = hf_format_parser("oryx-import", __doc__)
    hf.add_argument("hf_dir", help="a folder written by oryx-export hf (or save_pretrained of its model)")
    hf.add_argument("checkpoint_dir", help="the checkpoint.dir to write (iter_0000000 and latest)")
    hf.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the checkpoint (default 1)")
    hf.add_argument("--set", dest="overrides", nargs="+", default=[], metavar="KEY=VALUE",
                    help="run config keys, as oryx-train takes them (data.data_path=[...], train.train_iters=...)")
    return parser


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        raise InputError(f"argument --tp: must be >= 1, got {args.tp}")
    if not Path(args.hf_dir).is_dir():
        raise InputError(f"{args.hf_dir}: no such directory")
    try:
        from oryx_megatron.interop.hf_import import import_checkpoint
    except ImportError as e:
        raise InputError(f"{HF_NEEDS} ({e})") from e
    path = import_checkpoint(Path(args.hf_dir), Path(args.checkpoint_dir), args.tp, args.overrides)
    print(f"wrote {path} (TP={args.tp}); resume it with oryx-train checkpoint.dir={args.checkpoint_dir}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-import", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
