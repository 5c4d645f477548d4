"""oryx-generate: continue prompts with a trained checkpoint under an inference mode schedule.

    oryx-generate runs/ckpt --prompt "def main(" --schedule "prefill=linear decode=attention" \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --stop $'\\n\\n'

Prints each prompt with its continuation, then the stats of the run: tokens fed in each mode,
attention-token fraction, prefill and decode tokens/s, cache memory (KV vs recurrent state).
The tokenizer is the dataset's (``tokenizer.json`` next to its manifest, or the byte
tokenizer); ``--tokenizer`` overrides it (required for Megatron indexed datasets).
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

import torch

from data_prep import PrepError
from data_prep.tokenizer import EOD_TOKEN, AnyTokenizer, load_tokenizer
from oryx_megatron.data.loader import parse_blend
from oryx_megatron.data.shards import Manifest
from oryx_megatron.inference import GenerationStats, SamplingParams, generate, parse_schedule
from oryx_megatron.inference.checkpoint import load_model, resolve_checkpoint
from oryx_megatron.training.config import TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """CHECKPOINT, --device and --dtype (shared with oryx-eval)."""
    parser.add_argument("checkpoint", help="a checkpoint dir (iter_NNNNNNN) or a run's checkpoint.dir (uses 'latest')")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")


def load_checkpoint(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """(model on args.device, run config); a bad checkpoint path is a parser error naming it."""
    if not Path(args.checkpoint).is_dir():
        parser.error(f"checkpoint {args.checkpoint}: no such directory")
    try:
        resolve_checkpoint(args.checkpoint)
    except FileNotFoundError as e:
        parser.error(f"checkpoint {e}")
    model, run = load_model(args.checkpoint, DTYPES[args.dtype])
    return model.to(args.device), run


def schedule_arg(text: str):
    """argparse type: an inference schedule, its parse error as the argument's error."""
    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


def stop_ids(tokenizer: AnyTokenizer, texts: List[str]) -> List[int]:
    """The id of each stop text (each must be one token), plus EOD."""
    ids = [tokenizer.eod_id]
    for text in texts:
        encoded = tokenizer.encode_batch([text])[0]
        if len(encoded) != 1:
            raise ValueError(f"--stop {text!r} encodes to {len(encoded)} tokens; stop texts must be one token")
        ids.append(int(encoded[0]))
    return ids


def format_stats(stats: GenerationStats) -> str:
    """The stats table of a generate() call."""
    rows = [
        *((f"tokens fed in {mode} mode", f"{n:,}") for mode, n in stats.tokens_per_mode.items()),
        ("attention-token fraction", f"{stats.attention_fraction:.3f}"),
        ("prefill tokens/s", f"{stats.prefill_tokens_per_s:,.1f}  ({stats.prefill_tokens:,} tokens)"),
        ("decode tokens/s", f"{stats.decode_tokens_per_s:,.1f}  ({stats.decode_tokens:,} tokens)"),
        *((f"cache {kind} bytes", f"{n:,}") for kind, n in stats.cache_bytes.items()),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def read_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> List[str]:
    if args.prompt is not None:
        return args.prompt
    try:
        prompts = [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    except OSError as e:
        parser.error(f"--prompt-file {args.prompt_file}: {e.strerror}")
    if not prompts:
        parser.error(f"--prompt-file {args.prompt_file}: holds no prompt (one per non-empty line)")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oryx-generate", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", nargs="+", help="one or more prompts")
    prompts.add_argument("--prompt-file", help="a text file, one prompt per non-empty line")
    parser.add_argument("--schedule", type=schedule_arg, default=parse_schedule("all-attention"),
                        help="'all-attention', 'all-linear', 'prefill=MODE decode=MODE' or spans "
                             "'MODE:START-END,...,MODE:START-' (default all-attention)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", nargs="+", default=[],
                        help="one-token texts that end a continuation (EOD always does)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the dataset's)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error(f"argument --max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    except ValueError as e:
        parser.error(str(e))
    prompts = read_prompts(parser, args)
    model, run = load_checkpoint(parser, args)
    try:
        tokenizer = dataset_tokenizer(run, args.tokenizer)
        stops = stop_ids(tokenizer, args.stop)
    except (OSError, ValueError, PrepError) as e:
        parser.error(str(e))
    encoded = [ids.tolist() for ids in tokenizer.encode_batch(prompts)]
    if any(not ids for ids in encoded):
        parser.error("a prompt encodes to no tokens")
    result = generate(model, encoded, args.schedule, args.max_new_tokens, sampling=sampling,
                      stop_token_ids=stops, vocab_size=tokenizer.vocab_size)
    for i, (prompt, tokens, reason) in enumerate(zip(prompts, result.tokens, result.finish_reasons)):
        print(f"=== [{i}] {len(tokens)} tokens, finish: {reason}, schedule: {args.schedule}")
        print(prompt + tokenizer.decode(tokens))
    print("=== stats")
    print(format_stats(result.stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
