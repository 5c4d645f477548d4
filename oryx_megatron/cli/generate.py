"""oryx-generate: continue prompts with a trained checkpoint under an inference mode schedule.

    oryx-generate runs/ckpt --prompt "def main(" --schedule "prefill=linear decode=attention" \\
        --max-new-tokens 64 --temperature 0.8 --top-p 0.95 --stop $'\\n\\n'
    oryx-generate runs/ckpt --prompt "def main(" --schedule "router threshold=0.5"   # the model's router decides
    oryx-generate runs/ckpt --prompt "def main(" --schedule "router budget=0.1 chunk_size=16"

Router schedules (a checkpoint with a router, docs/routing.md): ``router threshold=P`` reads attention on
the chunks whose router probability reaches P; ``router budget=B [chunk_size=N]`` on at most a fraction B
of the tokens (the router's calibrated threshold, at least 0.5, under a causal quota), deciding per N tokens.

Prints each prompt with its continuation, then the stats of the run: tokens fed in each mode,
attention-token fraction, prefill and decode tokens/s, cache memory (KV vs recurrent state).
``--no-kv-cache`` generates linear-only without a KV cache; ``--speculative K`` decodes one
prompt by self-speculative decoding (linear drafts K tokens, attention verifies them). Every
family decodes with its cache; the Transformer baseline reads attention only (no linear
schedule, no --no-kv-cache, no --speculative) and decodes without CUDA graphs.
The tokenizer is the dataset's (``tokenizer.json`` next to its manifest, or the byte
tokenizer); ``--tokenizer`` overrides it (required for Megatron indexed datasets).
"""

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.common import add_model_arguments, load_checkpoint
from oryx_megatron.cli.errors import InputError, command_parser, run_command
from oryx_megatron.config import Mode
from oryx_megatron.data_prep.tokenizer import AnyTokenizer
from oryx_megatron.eval.ppl import document_reset_id
from oryx_megatron.inference import (
    ALL_ATTENTION,
    GenerationStats,
    SamplingParams,
    generate,
    parse_schedule,
    speculative_generate,
)
from oryx_megatron.inference.generation import NO_KV_CACHE, schedule_prompts
from oryx_megatron.inference.loading import dataset_tokenizer


def schedule_arg(text: str):
    """argparse type: an inference schedule, its parse error as the argument's error."""
    try:
        return parse_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    if stats.drafted:
        rows.append(("speculative drafted / accepted", f"{stats.drafted:,} / {stats.accepted:,}  "
                                                      f"(acceptance {stats.acceptance_rate:.3f})"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def read_prompts(args: argparse.Namespace) -> List[str]:
    if args.prompt is not None:
        return args.prompt
    try:
        prompts = [line for line in Path(args.prompt_file).read_text().splitlines() if line.strip()]
    except OSError as e:
        raise InputError(f"--prompt-file {args.prompt_file}: {e.strerror}") from e
    if not prompts:
        raise InputError(f"--prompt-file {args.prompt_file}: holds no prompt (one per non-empty line)")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    parser = command_parser("oryx-generate", __doc__)
    add_model_arguments(parser)
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", nargs="+", help="one or more prompts")
    prompts.add_argument("--prompt-file", help="a text file, one prompt per non-empty line")
    parser.add_argument("--schedule", type=schedule_arg, default=ALL_ATTENTION,
                        help="a mode schedule by name and fields, as in configs ('all_attention', 'all_linear', "
                             "'linear_then_attention n_last=16', 'switch_at t=64 before=linear after=attention', "
                             "...), 'prefill=MODE decode=MODE', spans 'MODE:START-END,...,MODE:START-', or the "
                             "model's router: 'router threshold=P' (e.g. 'router threshold=0.5') or 'router "
                             "budget=B [chunk_size=N]' (e.g. 'router budget=0.1') (default all_attention; see "
                             "docs/inference.md, docs/routing.md)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", nargs="+", default=[],
                        help="one-token texts that end a continuation (EOD always does)")
    parser.add_argument("--tokenizer", help="'byte' or a tokenizer.json (default: the dataset's)")
    parser.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                        help="keep no KV cache: linear-only generation (a schedule reading attention is refused)")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="self-speculative decoding of one prompt: linear mode drafts K tokens, attention "
                             "mode verifies them (generated tokens read attention; 0: off)")
    parser.add_argument("--prefill-chunk", type=int, metavar="N",
                        help="prefill N prompt tokens at a time (long prompts: one chunk's activations at a time)")
    parser.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="replay one-token decode steps from CUDA graphs (default: on CUDA devices)")
    return parser


def check_decoding(args: argparse.Namespace, n_prompts: int) -> None:
    """Errors of the decoding flags that need no model."""
    if args.speculative < 0:
        raise InputError(f"argument --speculative: must be >= 0, got {args.speculative}")
    if args.speculative and not args.kv_cache:
        raise InputError("--speculative verifies drafts in attention mode and needs the KV cache; drop --no-kv-cache")
    if args.speculative and n_prompts != 1:
        raise InputError(f"--speculative decodes one prompt at a time, got {n_prompts} prompts")
    if args.prefill_chunk is not None and (args.prefill_chunk < 1 or args.speculative):
        raise InputError(f"argument --prefill-chunk: {args.prefill_chunk} must be >= 1, without --speculative")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        raise InputError(f"--cuda-graphs needs --device cuda, got --device {args.device}")


def check_linear_only(args: argparse.Namespace, encoded: List[List[int]], vocab_size: int) -> None:
    """--no-kv-cache: no position the schedule feeds may read attention (checked before generating)."""
    schedule_prompts(encoded, args.schedule, args.max_new_tokens, vocab_size, "cpu").require_reads(Mode.LINEAR,
                                                                                                   NO_KV_CACHE)


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise InputError(f"argument --max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    prompts = read_prompts(args)
    check_decoding(args, len(prompts))
    model, run = load_checkpoint(args)
    tokenizer = dataset_tokenizer(run, args.tokenizer)
    stops = stop_ids(tokenizer, args.stop)
    if tokenizer.vocab_size > run.model.vocab_size:  # its ids would index past the model's embedding
        raise InputError(f"the tokenizer's vocab ({tokenizer.vocab_size}) is larger than the model's "
                     f"model.vocab_size={run.model.vocab_size} ({args.checkpoint})")
    encoded = [ids.tolist() for ids in tokenizer.encode_batch(prompts)]
    if any(not ids for ids in encoded):
        raise InputError("a prompt encodes to no tokens")
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    total = len(encoded[longest]) + args.max_new_tokens
    if total > run.model.max_sequence_length:
        raise InputError(f"prompt {longest}: {len(encoded[longest])} tokens + --max-new-tokens {args.max_new_tokens} = "
                     f"{total} exceeds the model's max_sequence_length {run.model.max_sequence_length}")
    if not args.kv_cache:
        check_linear_only(args, encoded, tokenizer.vocab_size)
    common = dict(sampling=sampling, stop_token_ids=stops, vocab_size=tokenizer.vocab_size,
                  cuda_graphs=args.cuda_graphs, reset_at_eod=document_reset_id(run))
    if args.speculative:
        result = speculative_generate(model, encoded, args.schedule, args.max_new_tokens, args.speculative, **common)
    else:
        result = generate(model, encoded, args.schedule, args.max_new_tokens, kv_cache=args.kv_cache,
                          prefill_chunk=args.prefill_chunk, **common)
    for i, (prompt, tokens, reason) in enumerate(zip(prompts, result.tokens, result.finish_reasons)):
        print(f"=== [{i}] {len(tokens)} tokens, finish: {reason}, schedule: {args.schedule}")
        print(prompt + tokenizer.decode(tokens))
    print("=== stats")
    print(format_stats(result.stats))
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-generate", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
