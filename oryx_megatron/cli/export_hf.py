"""oryx-export: a training checkpoint (any TP/PP layout) as a Hugging Face transformers folder (docs/hf.md).

    oryx-export hf runs/demo/checkpoints runs/demo/hf --dtype bfloat16

Writes config.json, model.safetensors (sharded above --max-shard-size), generation_config.json, the
dataset's tokenizer (tokenizer.json, tokenizer_config.json) and a README model card; Oryx models also carry
configuration_oryx.py and modeling_oryx.py (trust_remote_code=True), the Transformer is a stock Llama.
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.common import HF_NEEDS, hf_format_parser, load_checkpoint
from oryx_megatron.cli.errors import InputError, run_command
from oryx_megatron.data_prep.tokenizer import ByteTokenizer
from oryx_megatron.inference.checkpoint import resolve_checkpoint
from oryx_megatron.checkpoint import load_common
from oryx_megatron.inference.loading import DTYPES, dataset_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser, hf = hf_format_parser("oryx-export", __doc__)
    hf.add_argument("checkpoint", help="a checkpoint dir (iter_NNNNNNN) or a run's checkpoint.dir (uses 'latest')")
    hf.add_argument("out_dir", help="the folder to write (replaced if it exists)")
    hf.add_argument("--dtype", choices=sorted(DTYPES), help="weights' dtype (default: the run's training dtype); "
                                                            "A_log, dt_bias and D stay float32")
    hf.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the dataset's)")
    hf.add_argument("--metrics", type=Path, help="the run's metrics.jsonl: held-out losses for the model card "
                                                 "(default: logging.output_dir's, when the run set it)")
    hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    return parser


def tokenizer_files(run, spec: Optional[str]):
    """The run's tokenizer as ``TokenizerFiles`` (None for synthetic MQAR data, which has none)."""
    from oryx_megatron.interop.hf_export import TokenizerFiles

    if spec is None and run.data.format == "mqar":
        return None
    tokenizer = dataset_tokenizer(run, spec)
    path = None if isinstance(tokenizer, ByteTokenizer) else tokenizer.path
    eod_token = getattr(tokenizer, "eod_token", None) or "<|endoftext|>"
    return TokenizerFiles(path, eod_token, tokenizer.eod_id, tokenizer.vocab_size)


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        from oryx_megatron.interop.hf_export import export_model, heldout_losses
    except ImportError as e:
        raise InputError(f"{HF_NEEDS} ({e})") from e
    written = args.dtype
    args.device, args.dtype = "cpu", "float32"  # load_checkpoint's: loaded in fp32, then written in `written`
    model, run = load_checkpoint(args)
    iteration = int(load_common(resolve_checkpoint(args.checkpoint))["iteration"])
    dtype = DTYPES[written or ("bfloat16" if run.train.bf16 else "float32")]
    metrics = args.metrics
    if metrics is None and run.logging.output_dir and (Path(run.logging.output_dir) / "metrics.jsonl").exists():
        metrics = Path(run.logging.output_dir) / "metrics.jsonl"
    tokenizer = tokenizer_files(run, args.tokenizer)
    heldout = heldout_losses(metrics, iteration) if metrics is not None else {}
    out = export_model(model, run, Path(args.out_dir), dtype, tokenizer, iteration, heldout, args.max_shard_size)
    print(f"wrote {out} ({run.model.family}, iteration {iteration}, {str(dtype).replace('torch.', '')})")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-export", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
