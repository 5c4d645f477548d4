"""Tokenize a corpus into WebDataset shards plus a manifest, in parallel and resumably.

The shard plan (which input pieces go to which shard) depends only on the inputs and
settings, so the output is the same for any number of workers. Every finished shard
is recorded in ``progress.jsonl``; re-running with the same inputs and settings keeps
the recorded shards and writes only the missing ones.
"""

import functools
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import List

from tqdm import tqdm

from oryx_megatron.data.shards import MANIFEST, Manifest, ShardInfo, ShardWriter, token_dtype
from oryx_megatron.data_prep import PrepError
from oryx_megatron.data_prep.inputs import InputOptions, Piece, iter_documents, plan_shards
from oryx_megatron.data_prep.tokenizer import AnyTokenizer, HFTokenizer, load_tokenizer, train_bpe

PROGRESS = "progress.jsonl"
COUNTS = ("skipped_empty", "skipped_invalid_utf8", "replaced_invalid_utf8")
_ENCODE_BATCH = 64


def write_shard(job, out: Path, tokenizer: AnyTokenizer, options: InputOptions):
    """Tokenize ``job = (index, pieces)`` into ``shard-<index>.tar``; returns (index, ShardInfo, counts)."""
    index, pieces = job
    counts = Counter()
    path = out / f"shard-{index:06d}.tar"
    writer = ShardWriter(path, token_dtype(tokenizer.vocab_size))
    try:
        for piece in pieces:
            docs = iter_documents(piece, options, counts)
            while texts := list(itertools.islice(docs, _ENCODE_BATCH)):
                for ids in tokenizer.encode_batch(texts):
                    if len(ids) == 0:
                        counts["skipped_empty"] += 1
                    elif ids.max() >= tokenizer.vocab_size:
                        raise PrepError(
                            f"token id {int(ids.max())} >= vocab size {tokenizer.vocab_size} in a document of "
                            f"{piece.path}; the tokenizer's vocabulary is inconsistent"
                        )
                    else:
                        writer.add(ids)
        return index, writer.close(), counts
    except BaseException:
        Path(f"{path}.tmp").unlink(missing_ok=True)  # a failed shard leaves nothing behind
        raise


def _one_thread() -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes split the cores, not the tokenizer's threads


# A pool's processes take whole shards; one process with the tokenizer's own threads splits every batch instead, and
# kept 86% of 2 cores busy (172% CPU, the 150 MB corpus of docs/data.md). The pool is used where the shards keep its
# processes busy at least as well: the longest-first schedule of their input bytes within POOL_BALANCE of an even split.
POOL_BALANCE = 0.86


def processes(shard_bytes: List[int], workers: int) -> int:
    """The processes that write shards of these input bytes: ``workers``, or 1 (this process, with the tokenizer's
    threads) where whole shards would leave the pool's processes idle (fewer shards than workers, or shards of
    uneven sizes: of shards of 256 and 44 MiB, one process would tokenize 85% of the input alone)."""
    if workers <= 1 or len(shard_bytes) < workers:
        return 1
    loads = [0] * workers
    for size in sorted(shard_bytes, reverse=True):  # longest first, each to the least loaded process
        loads[loads.index(min(loads))] += size
    return workers if sum(loads) / workers >= POOL_BALANCE * max(loads) else 1


def _pool(workers: int):
    """``workers`` processes, each tokenizing with one thread (this process's setting is left as it was)."""
    return multiprocessing.Pool(workers, initializer=_one_thread)


def _remove_partial_shards(out: Path) -> None:
    """The ``.tmp`` files of shards that were being written when a run failed (other workers')."""
    for tmp in out.glob("shard-*.tar.tmp"):
        tmp.unlink(missing_ok=True)


def _fingerprint(files, shard_bytes: int, options: InputOptions, tokenizer: AnyTokenizer) -> str:
    stats = [os.stat(f) for f in files]
    settings = {"inputs": [[str(f), s.st_size, s.st_mtime_ns] for f, s in zip(files, stats)],
                "shard_bytes": shard_bytes, "options": dataclasses.asdict(options),
                "tokenizer": tokenizer.identity()}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def _load_progress(path: Path, fingerprint: str) -> dict:
    """Finished shards recorded by an earlier run with the same fingerprint, by index."""
    records = []
    if path.exists():
        lines = path.read_text().splitlines()
        if not lines or json.loads(lines[0]).get("fingerprint") != fingerprint:
            raise PrepError(
                f"{path.parent} holds shards of a run with other inputs or settings; "
                f"use another output directory or delete it"
            )
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass  # the torn last line of an interrupted run
    records = [r for r in records if (path.parent / r["shard"]["path"]).exists()]
    # Rewrite without torn lines, so that appends start on a fresh line.
    path.write_text("".join(json.dumps(r) + "\n" for r in [{"fingerprint": fingerprint}, *records]))
    return {r["index"]: r for r in records}


def tokenize_corpus(files, out, tokenizer: AnyTokenizer, *, shard_bytes: int = 256 << 20, workers: int = 1,
                    options: InputOptions = InputOptions(), progress: bool = True) -> Manifest:
    """Tokenize ``files`` into shards and ``manifest.json`` under ``out``; returns the manifest.
    Raises PrepError when the inputs hold no documents or no tokens; on any error no ``.tmp``
    file is left, and ``out`` is removed if this call created it."""
    out = Path(out)
    created = not out.exists()
    try:
        return _tokenize_corpus(files, out, tokenizer, shard_bytes, workers, options, progress)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        elif out.is_dir():
            _remove_partial_shards(out)
        raise


def _tokenize_corpus(files, out: Path, tokenizer: AnyTokenizer, shard_bytes: int, workers: int,
                     options: InputOptions, progress: bool) -> Manifest:
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(files, shard_bytes, options)
    done = _load_progress(out / PROGRESS, _fingerprint(files, shard_bytes, options, tokenizer))
    tokenizer_file = None
    if isinstance(tokenizer, HFTokenizer):  # the dataset carries its tokenizer
        tokenizer_file = "tokenizer.json"
        if tokenizer.path.resolve() != (out / tokenizer_file).resolve():
            shutil.copyfile(tokenizer.path, out / tokenizer_file)
    todo = [(i, plan[i]) for i in range(len(plan)) if i not in done]
    job = functools.partial(write_shard, out=out, tokenizer=tokenizer, options=options)
    workers = processes([sum(piece.nbytes for piece in pieces) for _, pieces in todo], workers)

    start, new_tokens = time.perf_counter(), 0
    bar = tqdm(total=len(plan), initial=len(done), unit="shard", desc="tokenize", disable=not progress)
    try:  # the bar is closed before an error propagates: its message gets a line of its own
        with open(out / PROGRESS, "a") as log, _pool(workers) if workers > 1 else nullcontext() as pool:
            for index, shard, counts in pool.imap_unordered(job, todo) if pool else map(job, todo):
                record = {"index": index, "shard": vars(shard), "counts": dict(counts)}
                log.write(json.dumps(record) + "\n")
                log.flush()
                done[index] = record
                new_tokens += shard.tokens
                bar.update()
                bar.set_postfix_str(f"{new_tokens / (time.perf_counter() - start):,.0f} tok/s")
    finally:
        bar.close()

    records = [done[i] for i in range(len(plan))]
    counts = sum((Counter(r["counts"]) for r in records), Counter())
    shards = [ShardInfo(**r["shard"]) for r in records]
    stats = {"input_files": len(files), "documents": sum(s.documents for s in shards),
             "tokens": sum(s.tokens for s in shards), **{k: counts[k] for k in COUNTS}}
    if stats["documents"] == 0 or stats["tokens"] == 0:
        skipped = ", ".join(f"{k.removeprefix('skipped_')} {stats[k]}" for k in COUNTS if k.startswith("skipped"))
        raise PrepError(f"the {len(files)} input files hold no documents to tokenize "
                        f"({stats['documents']} documents, {stats['tokens']} tokens; skipped: {skipped})")
    manifest = Manifest(
        tokenizer={**tokenizer.identity(), "file": tokenizer_file}, vocab_size=tokenizer.vocab_size, eod_id=tokenizer.eod_id,
        token_dtype=token_dtype(tokenizer.vocab_size).name, shards=shards, stats=stats, root=out,
    )
    manifest.write(out / MANIFEST)
    seconds = time.perf_counter() - start
    print(f"{out / MANIFEST}: {len(shards)} shards, {stats['documents']:,} documents, {stats['tokens']:,} tokens "
          f"({len(todo)} shards written, {new_tokens:,} tokens in {seconds:.1f} s = {new_tokens / seconds:,.0f} tok/s)")
    print("skipped: " + ", ".join(f"{k.removeprefix('skipped_')} {stats[k]}" for k in COUNTS if k.startswith("skipped"))
          + f"; invalid UTF-8 replaced in {stats['replaced_invalid_utf8']} documents")
    return manifest


def train_corpus_tokenizer(files, options: InputOptions, vocab_size: int, out: Path) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` trained on the documents of ``files``, written to ``out``. Refuses
    (PrepError, nothing left behind) inputs that hold no document: they would train a bytes-only BPE."""
    counts, seen = Counter(), [0]

    def texts():
        for f in files:
            for text in iter_documents(Piece(str(f)), options, counts):
                seen[0] += 1
                yield text

    print(f"training a byte-level BPE (vocab {vocab_size}) on {len(files)} files -> {out}")
    created = not out.parent.exists()
    tokenizer = train_bpe(texts(), vocab_size, out)
    if seen[0] == 0:
        out.unlink(missing_ok=True)
        if created:
            shutil.rmtree(out.parent, ignore_errors=True)
        skipped = ", ".join(f"{k.removeprefix('skipped_')} {n}" for k, n in sorted(counts.items()) if k.startswith("skipped"))
        raise PrepError(f"the {len(files)} input files hold no documents to train a tokenizer on"
                        f" (skipped: {skipped or 'none'})")
    return tokenizer


def tokenize_dataset(files, out: Path, tokenizer_spec, vocab_size: int, eod_token: str, *, shard_bytes: int,
                     workers: int, options: InputOptions) -> Manifest:
    """``tokenize_corpus`` with the tokenizer ``tokenizer_spec`` (a tokenizer.json or 'byte'), or, when None,
    a BPE of ``vocab_size`` trained on the inputs first (``out``/tokenizer.json: an interrupted run's is reused).
    On an error ``out`` is removed if this call created it."""
    created = not out.exists()
    try:
        if tokenizer_spec:
            tokenizer = load_tokenizer(tokenizer_spec, eod_token)
        elif (out / "tokenizer.json").exists():
            tokenizer = HFTokenizer(out / "tokenizer.json", eod_token)
        else:
            tokenizer = train_corpus_tokenizer(files, options, vocab_size, out / "tokenizer.json")
        return tokenize_corpus(files, out, tokenizer, shard_bytes=shard_bytes, workers=workers, options=options)
    except BaseException:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
