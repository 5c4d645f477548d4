import hashlib
import itertools
import os
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from oryx_megatron.cli.prep import main
from oryx_megatron.data.loader import ShardLoader
from oryx_megatron.data.shards import Manifest, read_documents
from oryx_megatron.data_prep import PrepError
from oryx_megatron.data_prep.inputs import InputOptions, Piece, expand_inputs, iter_documents, plan_shards, stdlib_files
from oryx_megatron.data_prep.pipeline import processes, tokenize_corpus
from oryx_megatron.data_prep.tokenizer import ByteTokenizer, train_bpe
from tests.data.conftest import LINE_BYTES, prepare, unique_docs, write_jsonl


def _mixed_corpus(tmp_path):
    """JSONL, Parquet (3 row groups) and plain-text inputs; returns (files, documents in any order)."""
    rng = np.random.default_rng(0)
    words = ["def", "return", "self", "x", "=", "(", ")", ":", "é", "数据", "\n", "    "]
    docs = ["".join(rng.choice(words, rng.integers(1, 60))) + f" #{i}" for i in range(60)]
    jsonl = write_jsonl(tmp_path / "a.jsonl", docs[:30])
    parquet = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": docs[30:50]}), parquet, row_group_size=7)
    (tmp_path / "txt").mkdir()
    for i, doc in enumerate(docs[50:]):
        (tmp_path / "txt" / f"{i:02d}.txt").write_text(doc)
    return expand_inputs([str(jsonl), str(parquet), str(tmp_path / "txt")]), docs


def _stream(manifest):
    """The first epoch of a one-rank loader's token stream, cut into documents at EOD: its
    samples (windows of 2 tokens, seq_len 1, which cover the whole stream) put back in stream
    order by the documented sample permutation (docs/data.md)."""
    length = manifest.tokens + manifest.documents
    loader = ShardLoader(manifest.root, seq_len=1, micro_batch_size=length - 1, seed=5)
    batch = next(loader)
    tokens = [0] * length
    for k, w in enumerate(np.random.default_rng([5, 0, 0, 3]).permutation(length - 1)):
        tokens[w:w + 2] = [int(batch["tokens"][k, 0]), int(batch["labels"][k, 0])]
    docs = " ".join(map(str, tokens)).split(f" {manifest.eod_id}")
    assert docs[-1] == ""  # the epoch ends with an EOD
    return sorted(tuple(map(int, d.split())) for d in docs[:-1])


def test_round_trip_text_to_loader(tmp_path):
    files, docs = _mixed_corpus(tmp_path)
    tokenizer = train_bpe(docs, 300, tmp_path / "tokenizer.json")
    manifest = tokenize_corpus(files, tmp_path / "out", tokenizer, shard_bytes=700, workers=2, progress=False)
    expected = tokenizer.encode_batch(docs)
    assert len(manifest.shards) > 3
    assert manifest.documents == manifest.stats["documents"] == len(docs)
    assert manifest.tokens == manifest.stats["tokens"] == sum(len(e) for e in expected)
    for shard in manifest.shards:
        found = read_documents(manifest.shard_path(shard))
        assert (len(found), sum(map(len, found))) == (shard.documents, shard.tokens)
    assert manifest.tokenizer["sha256"] == hashlib.sha256((tmp_path / "out" / "tokenizer.json").read_bytes()).hexdigest()
    assert _stream(manifest) == sorted(tuple(e.tolist()) for e in expected)
    assert tokenizer.decode(expected[7]) == docs[7]


def test_split_pieces_hold_every_document_once(tmp_path):
    files, _ = _mixed_corpus(tmp_path)
    whole = [d for f in files for d in iter_documents(Piece(str(f)), InputOptions(), Counter())]
    for shard_bytes in (50, 333, 1000):
        plan = plan_shards(files, shard_bytes, InputOptions())
        pieces = [d for shard in plan for piece in shard for d in iter_documents(piece, InputOptions(), Counter())]
        assert pieces == whole
        counted = Counter()  # the plan's input bytes per file: its size (Parquet: the row groups' sizes)
        for piece in (piece for shard in plan for piece in shard):
            counted[piece.path] += piece.nbytes
        groups = pq.ParquetFile(files[1]).metadata
        assert counted == {str(f): sum(groups.row_group(i).total_byte_size for i in range(groups.num_row_groups))
                           if f.suffix == ".parquet" else f.stat().st_size for f in files}


def test_processes_keep_the_pool_busy_or_leave_the_cores_to_the_tokenizer():
    """A pool of whole shards where the longest-first schedule stays within POOL_BALANCE of an even split, else one
    process with the tokenizer's threads (the 300 MiB corpus of docs/data.md: shards of 256 and 44 MiB)."""
    assert processes([256, 44], 2) == 1  # one process would tokenize 85% of the input alone
    assert processes([256, 256, 256], 2) == 1  # 2 shards to one process: an even split is 75% of it
    assert processes([256] * 7 + [44], 2) == 2  # 1,024 + 812: 0.90 of the longer
    assert processes([256] * 4, 4) == 4
    assert processes([256], 2) == processes([256] * 8, 1) == 1


def _digest(out):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("shard-*.tar"))}


def test_output_is_deterministic_and_independent_of_workers(tmp_path):
    docs = unique_docs("d", 50)
    one = prepare(tmp_path, docs, 7, name="one", workers=1)
    two = prepare(tmp_path, docs, 7, name="two", workers=2)
    assert len(one.shards) == 8
    assert _digest(one.root) == _digest(two.root)
    assert (one.root / "manifest.json").read_text() == (two.root / "manifest.json").read_text()
    ds = wds.WebDataset(str(one.shard_path(one.shards[0])), shardshuffle=False).decode()
    sample = next(iter(ds))
    assert sample["tokens.npy"].dtype == np.uint16 and sample["lengths.npy"].tolist() == [40] * 7


def test_rerun_keeps_finished_shards(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", unique_docs("d", 40))

    def run(docs_per_shard):
        return tokenize_corpus([src], tmp_path / "out", ByteTokenizer(), shard_bytes=docs_per_shard * LINE_BYTES,
                               progress=False)

    manifest = run(10)
    before = _digest(manifest.root)
    stamps = {p: p.stat().st_mtime_ns for p in manifest.root.glob("shard-*.tar")}
    (manifest.root / "shard-000002.tar").unlink()
    with open(manifest.root / "progress.jsonl", "a") as f:
        f.write('{"index": 3, "sha')  # the torn last line of an interrupted run
    again = run(10)
    assert _digest(again.root) == before and again == manifest
    changed = [p.name for p, t in stamps.items() if not p.exists() or p.stat().st_mtime_ns != t]
    assert changed == ["shard-000002.tar"]
    with pytest.raises(PrepError, match="holds shards of a run with other inputs or settings"):
        run(5)


class _BadVocab(ByteTokenizer):
    vocab_size = 100


def test_bad_inputs_give_named_errors_or_counted_skips(tmp_path, capsys):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\t")
    (tmp_path / "d.jsonl").write_bytes(b'{"text": "x"}\n\n{"text": ""}\n{"text": null}\n{"text": "bad \xff"}\n')
    files = sorted(tmp_path.glob("*"))
    manifest = tokenize_corpus(files, tmp_path / "out", ByteTokenizer(), progress=False)
    assert {k: manifest.stats[k] for k in ("documents", "skipped_empty", "replaced_invalid_utf8")} == {
        "documents": 4, "skipped_empty": 4, "replaced_invalid_utf8": 2}
    assert "skipped: empty 4, invalid_utf8 0; invalid UTF-8 replaced in 2 documents" in capsys.readouterr().out
    skip = tokenize_corpus(files, tmp_path / "skip", ByteTokenizer(), options=InputOptions(invalid_utf8="skip"),
                           progress=False)
    assert (skip.stats["documents"], skip.stats["skipped_invalid_utf8"]) == (2, 2)

    runs = itertools.count()

    def fails(match, files, tokenizer=ByteTokenizer()):
        with pytest.raises(PrepError, match=match):
            tokenize_corpus(files, tmp_path / f"fail{next(runs)}", tokenizer, progress=False)

    os.symlink(tmp_path / "gone.txt", tmp_path / "link.txt")
    fails(r"cannot read .*link\.txt", [tmp_path / "link.txt"])
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    fails(r"cannot read .*bad\.parquet", [tmp_path / "bad.parquet"])
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{"text": \n')
    fails(r"broken\.jsonl \(byte 14\): invalid JSON", [tmp_path / "broken.jsonl"])
    (tmp_path / "other.jsonl").write_text('{"body": "a"}\n')
    fails(r"other\.jsonl \(byte 0\): no field 'text' \(found: body\)", [tmp_path / "other.jsonl"])
    fails(r"token id 1\d\d >= vocab size 100 in a document of .*ok\.txt", [tmp_path / "ok.txt"], _BadVocab())
    with pytest.raises(PrepError, match="input 'nowhere/x.txt' does not exist"):
        expand_inputs(["nowhere/x.txt"])
    with pytest.raises(PrepError, match=r"matched no files"):
        expand_inputs([str(tmp_path / "*.csv")])


def test_cli_trains_tokenizes_and_inspects(tmp_path, capsys):
    files, docs = _mixed_corpus(tmp_path)
    out = tmp_path / "out"
    assert main(["tokenize", str(tmp_path / "a.jsonl"), str(tmp_path / "txt"), "--out", str(out),
                 "--vocab-size", "300", "--shard-size", "1K", "--workers", "2"]) == 0
    manifest = Manifest.read(out)
    assert manifest.tokenizer["kind"] == "hf" and manifest.vocab_size == 300 and manifest.documents == 40
    assert main(["inspect", str(out), "--show", "1"]) == 0
    assert f"{len(manifest.shards)} shards, 40 documents" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["tokenize", str(tmp_path / "missing"), "--out", str(out)])
    assert exit_info.value.code == 2 and "oryx-prep: error: input" in capsys.readouterr().err


def test_stdlib_corpus_is_the_interpreters_sources():
    files = stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "__init__.py"} <= names and len(files) > 500
    assert not any("site-packages" in f.parts for f in files)


def test_bpe_shards_equal_for_any_workers_and_shard_count(tmp_path):
    """Fewer shards than workers (one process, the tokenizer's threads) and more (a pool of one-thread
    processes) write the bytes one worker writes; the pool leaves this process's tokenizer threads on."""
    files, docs = _mixed_corpus(tmp_path)
    tokenizer = train_bpe(docs, 300, tmp_path / "tokenizer.json")
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    for shard_bytes, shards in ((1 << 20, 1), (700, 9)):
        runs = {w: tokenize_corpus(files, tmp_path / f"out-{shard_bytes}-{w}", tokenizer, shard_bytes=shard_bytes,
                                   workers=w, progress=False) for w in (1, 2, 16)}
        assert [len(m.shards) for m in runs.values()] == [shards] * 3
        assert _digest(runs[2].root) == _digest(runs[16].root) == _digest(runs[1].root)
        assert (runs[1].root / "manifest.json").read_text() == (runs[16].root / "manifest.json").read_text()
    assert "TOKENIZERS_PARALLELISM" not in os.environ
