"""``oryx-prep``: train a tokenizer, tokenize a corpus into shards, inspect a dataset.

    oryx-prep tokenize --stdlib --out data/stdlib              # demo: train a BPE, then tokenize
    oryx-prep train-tokenizer corpus/ --vocab-size 32768 --out tok.json
    oryx-prep tokenize 'corpus/**/*.jsonl' --tokenizer tok.json --out data/corpus
    oryx-prep inspect data/corpus --show 2
"""

import argparse
import os
import sys
from pathlib import Path
from typing import List, Optional

from oryx_megatron.cli.errors import command_parser, run_command
from oryx_megatron.data.shards import Manifest, read_documents
from oryx_megatron.data_prep import PrepError
from oryx_megatron.data_prep.inputs import InputOptions, check_text_inputs, expand_inputs, stdlib_files
from oryx_megatron.data_prep.pipeline import tokenize_dataset, train_corpus_tokenizer
from oryx_megatron.data_prep.tokenizer import EOD_TOKEN, ByteTokenizer, HFTokenizer


def _size(text: str) -> int:
    """'256M' -> 268435456 (suffixes K, M, G: powers of 1024)."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M, 1G)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def _input_arguments() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("inputs", nargs="*", help="files, directories (walked) or globs")
    p.add_argument("--stdlib", action="store_true",
                   help="add the running Python's standard library sources (the offline demo corpus)")
    p.add_argument("--include", default="*", help="file-name pattern when walking directories (default: *)")
    p.add_argument("--field", default="text", help="JSONL field / Parquet column holding the text (default: text)")
    p.add_argument("--text-unit", choices=("file", "line"), default="file",
                   help="plain text: one document per file or per line (default: file)")
    p.add_argument("--invalid-utf8", choices=("replace", "skip"), default="replace",
                   help="documents with invalid UTF-8: replace bad bytes with U+FFFD or skip them; counted")
    p.add_argument("--allow-binary", action="store_true",
                   help="tokenize inputs that look binary (NUL bytes, mostly invalid UTF-8); refused by default")
    return p


def _inputs(args):
    files = expand_inputs(args.inputs, args.include) + (stdlib_files() if args.stdlib else [])
    if not files:
        raise PrepError("no inputs: name files, directories or globs, or pass --stdlib")
    if not args.allow_binary:
        check_text_inputs(files)
    options = InputOptions(jsonl_field=args.field, text_unit=args.text_unit, invalid_utf8=args.invalid_utf8,
                           include=args.include)
    return files, options


def _train_tokenizer(args):
    files, options = _inputs(args)
    train_corpus_tokenizer(files, options, args.vocab_size, Path(args.out))


def _tokenize(args):
    files, options = _inputs(args)
    tokenize_dataset(files, Path(args.out), args.tokenizer, args.vocab_size, args.eod_token,
                     shard_bytes=args.shard_size, workers=args.workers, options=options)


def _inspect(args):
    manifest = Manifest.read(args.dataset)
    print(f"{manifest.root}: {len(manifest.shards)} shards, {manifest.documents:,} documents, "
          f"{manifest.tokens:,} tokens ({manifest.token_dtype})")
    print(f"tokenizer: {manifest.tokenizer}, vocab {manifest.vocab_size}, EOD id {manifest.eod_id}")
    print("prep stats: " + ", ".join(f"{k} {v:,}" for k, v in manifest.stats.items()))
    if args.show:
        file = manifest.tokenizer.get("file")
        tokenizer = HFTokenizer(manifest.root / file, manifest.tokenizer["eod_token"]) if file else ByteTokenizer()
        for i, ids in enumerate(read_documents(manifest.shard_path(manifest.shards[0]))[:args.show]):
            text = tokenizer.decode(ids)
            print(f"--- document {i}: {len(ids)} tokens\n{text[:500]}{' [...]' if len(text) > 500 else ''}")


def build_parser() -> argparse.ArgumentParser:
    inputs = _input_arguments()
    parser = command_parser("oryx-prep", __doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("train-tokenizer", parents=[inputs], help="train a byte-level BPE on a corpus")
    p.add_argument("--out", required=True, help="where to write tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=8192, help="default: 8192")
    p.set_defaults(run=_train_tokenizer)

    p = commands.add_parser("tokenize", parents=[inputs], help="tokenize a corpus into WebDataset shards")
    p.add_argument("--out", required=True, help="output directory (re-running resumes it)")
    p.add_argument("--tokenizer", help="a tokenizer.json, or 'byte'; default: train a byte-level BPE on the "
                                       "inputs first (OUT/tokenizer.json)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocab of that BPE (default: 8192)")
    p.add_argument("--eod-token", default=EOD_TOKEN, help=f"end-of-document token (default: {EOD_TOKEN})")
    p.add_argument("--shard-size", type=_size, default="256M", help="input bytes per shard (default: 256M)")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="tokenizer processes")
    p.set_defaults(run=_tokenize)

    p = commands.add_parser("inspect", help="summarize a dataset and show its first documents")
    p.add_argument("dataset", help="a dataset directory or its manifest.json")
    p.add_argument("--show", type=int, default=1, help="documents of the first shard to decode (default: 1)")
    p.set_defaults(run=_inspect)

    return parser


def _main(argv: List[str]) -> int:
    args = build_parser().parse_args(argv)
    args.run(args)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    return run_command("oryx-prep", _main, argv)


if __name__ == "__main__":
    sys.exit(main())
