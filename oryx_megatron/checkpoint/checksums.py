"""The checksum of every file of a checkpoint: ``checksums.sha256``, in ``sha256sum``'s format (one
``<64 hex digits>  <file name>`` line per file; ``cd iter_0000100 && sha256sum -c checksums.sha256`` checks it
by hand). A save writes it after every other file of the checkpoint and before `latest` names the checkpoint
(``oryx_megatron.training.saving``), under a temporary name renamed into place: a save cut off anywhere leaves
no checksum file, and one that is there lists every file. Loading re-hashes each file it lists
(``verify_checksums``); a checkpoint written before checksums existed has no such file and is verified by its
structure alone (``verify.verify_checkpoint``)."""

import hashlib
import os
import re
from pathlib import Path
from typing import Dict, Optional

from oryx_megatron.checkpoint.files import CheckpointError

CHECKSUMS = "checksums.sha256"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")
_READ_BYTES = 8 << 20


class ChecksumMismatch(CheckpointError):
    """A file of a checkpoint whose bytes are not the ones its save wrote (its length may be right)."""


def file_sha256(file: Path) -> str:
    """The sha256 of a file's bytes, in hex."""
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def write_checksums(path: Path, hashed: Optional[Dict[str, str]] = None) -> None:
    """Write ``path``'s checksum file: ``hashed`` (file name -> sha256 of files hashed where they were
    written) and every other file of the directory, hashed here."""
    hashed = hashed or {}
    path = Path(path)
    tmp = path / f"{CHECKSUMS}.tmp"
    names = sorted(p.name for p in path.iterdir() if p.is_file() and p.name not in (CHECKSUMS, tmp.name))
    lines = "".join(f"{hashed.get(name) or file_sha256(path / name)}  {name}\n" for name in names)
    with open(tmp, "w") as f:
        f.write(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / CHECKSUMS)


def read_checksums(path: Path) -> Dict[str, str]:
    """File name -> sha256 as ``path``'s checksum file lists them (CheckpointError when it is garbled)."""
    recorded = {}
    for number, line in enumerate((Path(path) / CHECKSUMS).read_text().splitlines(), 1):
        match = _LINE.match(line)
        if match is None or "/" in match.group(2):
            raise CheckpointError(path, f"{CHECKSUMS} is unreadable (line {number} is not '<sha256>  <file>')")
        recorded[match.group(2)] = match.group(1)
    if not recorded:
        raise CheckpointError(path, f"{CHECKSUMS} is empty")
    return recorded


def verify_checksums(path: Path) -> bool:
    """Re-hash every file that ``path``'s checksum file lists: ChecksumMismatch naming the first whose bytes
    differ, CheckpointError when one is missing. True when verified; False when the checkpoint has no
    checksum file (it was written before checksums)."""
    path = Path(path)
    if not (path / CHECKSUMS).is_file():
        return False
    for name, expected in sorted(read_checksums(path).items()):
        if not (path / name).is_file():
            raise CheckpointError(path, f"{name} is missing (named by {CHECKSUMS})")
        actual = file_sha256(path / name)
        if actual != expected:
            raise ChecksumMismatch(path, f"{name} does not match its checksum (sha256 {actual[:16]}..., "
                                         f"{CHECKSUMS} records {expected[:16]}...)")
    return True
