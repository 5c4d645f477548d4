"""Input corpora: which files, how they split into shards, and the documents they hold.

Formats, by file name: ``*.jsonl`` / ``*.ndjson`` (one JSON object per line, text in
a configurable field), ``*.parquet`` (a text column), anything else plain text (one
document per file, or per line with ``text_unit="line"``). ``.gz`` inputs are read
whole. Everything is streamed: at most one document is held in memory.
"""

import dataclasses
import glob
import gzip
import json
import os
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from oryx_megatron.data_prep import PrepError


@dataclasses.dataclass(frozen=True)
class InputOptions:
    jsonl_field: str = "text"  # also the Parquet column
    text_unit: str = "file"  # plain text: one document per "file" or per "line"
    invalid_utf8: str = "replace"  # "replace" (U+FFFD) or "skip" the document; both counted
    include: str = "*"  # file-name pattern when walking directories

    def __post_init__(self):
        if self.text_unit not in ("file", "line"):
            raise PrepError(f"text_unit must be 'file' or 'line', got {self.text_unit!r}")
        if self.invalid_utf8 not in ("replace", "skip"):
            raise PrepError(f"invalid_utf8 must be 'replace' or 'skip', got {self.invalid_utf8!r}")


@dataclasses.dataclass(frozen=True)
class Piece:
    """A part of one input file: a byte range (line-based files) or a row-group range
    (Parquet); ``end=None`` reads to the end of the file."""

    path: str
    start: int = 0
    end: Optional[int] = None
    nbytes: int = dataclasses.field(default=0, compare=False)  # its input bytes, as the plan counts them


def stdlib_files() -> List[Path]:
    """The demo corpus: the running interpreter's standard library sources (offline everywhere)."""
    files = []
    for folder, subfolders, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]  # not the stdlib
        files += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(files)


def expand_inputs(specs: List[str], include: str = "*") -> List[Path]:
    """Files named by paths, directories (walked, sorted, filtered by ``include``) and globs,
    in the order given."""
    files = []
    for spec in specs:
        path = Path(spec)
        if path.is_dir():
            found = sorted(p for p in path.rglob(include) if p.is_file())
        elif glob.has_magic(spec):
            found = sorted(Path(p) for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
        elif os.path.lexists(spec):
            found = [path]
        else:
            raise PrepError(f"input {spec!r} does not exist")
        if not found:
            raise PrepError(f"input {spec!r} matched no files")
        files.extend(found)
    return files


def _kind(path: str) -> str:
    name = path.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def _units(path: str, options: InputOptions):
    """(start, end, bytes, divisible) parts of a file that shards are made of."""
    try:
        if _kind(path) == "parquet":
            meta = pq.ParquetFile(path).metadata
            return [(i, i + 1, meta.row_group(i).total_byte_size, False) for i in range(meta.num_row_groups)]
        size = os.path.getsize(path)
    except (OSError, pa.ArrowException) as e:
        raise PrepError(f"cannot read {path}: {e}") from None
    line_based = _kind(path) == "jsonl" or options.text_unit == "line"
    if line_based and not path.endswith(".gz"):
        return [(0, size, size, True)]
    return [(0, None, size, False)]


def plan_shards(files: List[Path], shard_bytes: int, options: InputOptions) -> List[List[Piece]]:
    """Cut the inputs, in order, into shards of about ``shard_bytes`` input bytes.

    Line-based files are cut at the byte where a shard is full (the line that straddles
    the cut goes to the earlier piece); Parquet files at row groups; other files stay whole.
    The plan depends only on the files and settings, never on the number of workers.
    """
    shards, current, room = [], [], shard_bytes

    def add(path, start, end, size):
        if current and current[-1].path == path and current[-1].end == start:
            current[-1] = Piece(path, current[-1].start, end, current[-1].nbytes + size)  # consecutive row groups
        else:
            current.append(Piece(path, start, end, size))

    for file in map(str, files):
        for start, end, size, divisible in _units(file, options):
            while divisible and size > room:
                add(file, start, start + room, room)
                start, size = start + room, size - room
                shards.append(current)
                current, room = [], shard_bytes
            add(file, start, end, size)
            room -= size
            if room <= 0:
                shards.append(current)
                current, room = [], shard_bytes
    if current:
        shards.append(current)
    return shards


def _decode(data: bytes, options: InputOptions, counts: Counter) -> Optional[str]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        if options.invalid_utf8 == "skip":
            counts["skipped_invalid_utf8"] += 1
            return None
        counts["replaced_invalid_utf8"] += 1
        return data.decode("utf-8", "replace")


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _lines(piece: Piece) -> Iterator[tuple]:
    """(byte offset, line) for the lines that start inside the piece."""
    with _open(piece.path) as f:
        if piece.start > 0:
            f.seek(piece.start - 1)
            f.readline()  # finish the line that started before the piece
        while piece.end is None or f.tell() < piece.end:
            offset, line = f.tell(), f.readline()
            if not line:
                return
            yield offset, line


def _jsonl_texts(piece: Piece, options: InputOptions, counts: Counter) -> Iterator[Optional[str]]:
    field = options.jsonl_field
    for offset, line in _lines(piece):
        line = _decode(line, options, counts)
        if line is None or not line.strip():
            continue  # a skipped (counted) invalid line, or a blank line between records
        where = f"{piece.path} (byte {offset})"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepError(f"{where}: invalid JSON: {e}") from None
        if not isinstance(record, dict) or field not in record:
            keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
            raise PrepError(f"{where}: no field {field!r} (found: {keys}); set the JSONL field option")
        text = "" if record[field] is None else record[field]
        if not isinstance(text, str):
            raise PrepError(f"{where}: field {field!r} is {type(text).__name__}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates from \uXXXX escapes
            text = _decode(text.encode("utf-8", "surrogatepass"), options, counts)
        yield text


def _parquet_texts(piece: Piece, options: InputOptions, counts: Counter) -> Iterator[Optional[str]]:
    file = pq.ParquetFile(piece.path)
    field = options.jsonl_field
    if field not in file.schema_arrow.names:
        raise PrepError(f"{piece.path}: no column {field!r} (found: {', '.join(file.schema_arrow.names)})")
    end = file.num_row_groups if piece.end is None else piece.end
    for batch in file.iter_batches(batch_size=1024, columns=[field], row_groups=range(piece.start, end)):
        for value in batch.column(0).to_pylist():
            yield _decode(value, options, counts) if isinstance(value, bytes) else value or ""


def _text_docs(piece: Piece, options: InputOptions, counts: Counter) -> Iterator[Optional[str]]:
    if options.text_unit == "line":
        for _, line in _lines(piece):
            yield _decode(line.rstrip(b"\r\n"), options, counts)
    else:
        with _open(piece.path) as f:
            yield _decode(f.read(), options, counts)


_SNIFF_BYTES = 8192
_TEXT_CONTROLS = set(b"\t\n\r\f\v\x1b")


def binary_reason(path) -> Optional[str]:
    """Why a text or JSONL input looks binary (a NUL byte, or mostly control bytes in its first
    8 KiB), or None. Invalid UTF-8 alone is not binary: text in a legacy 8-bit encoding (the
    stdlib has KOI8-R and Latin-1 files) is what --invalid-utf8 decides about. Parquet files are
    binary by design: None."""
    path = str(path)
    if _kind(path) == "parquet":
        return None
    try:
        with _open(path) as f:
            head = f.read(_SNIFF_BYTES)
    except (OSError, EOFError) as e:
        raise PrepError(f"cannot read {path}: {e}") from None
    if b"\0" in head:
        return f"a NUL byte at offset {head.index(0)}"
    controls = sum(b < 32 and b not in _TEXT_CONTROLS for b in head)
    if len(head) >= 64 and controls > 0.3 * len(head):
        return f"{controls} of its first {len(head)} bytes are control bytes"
    return None


def check_text_inputs(files: List[Path]) -> None:
    """Refuse inputs that look binary (``binary_reason``), naming the first."""
    for f in files:
        reason = binary_reason(f)
        if reason:
            raise PrepError(f"{f} looks binary ({reason}); pass --allow-binary to tokenize it anyway")


def iter_documents(piece: Piece, options: InputOptions, counts: Counter) -> Iterator[str]:
    """The non-empty documents of a piece; skips are counted in ``counts``."""
    read = {"jsonl": _jsonl_texts, "parquet": _parquet_texts, "text": _text_docs}[_kind(piece.path)]
    try:
        for text in read(piece, options, counts):
            if text is None:
                continue
            if not text or text.isspace():
                counts["skipped_empty"] += 1
                continue
            yield text
    except (OSError, EOFError, pa.ArrowException) as e:
        raise PrepError(f"cannot read {piece.path}: {e}") from None
