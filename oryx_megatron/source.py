"""The source this code runs from: the git commit of its checkout and whether the working tree differs from it.

Read once per process (``git_source``), by its first trainer, before it trains: the files may change while it runs,
the code it imported does not. Training records it in W&B's config and in the common state of every checkpoint it
saves (``source``), so that a checkpoint says which code trained it up to that save; ``oryx-experiment`` lists it for
each run it reuses. An installed wheel (or a copy without ``.git``) has no checkout: None.
"""

import functools
import subprocess
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]  # the checkout, when the package lies in one


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_source() -> Optional[dict]:
    """{commit, uncommitted_changes (tracked files only), commit_date} of the checkout this package lies in (a new
    dict each call, read once per process); None when it lies in none (a wheel installed into a virtual environment
    inside some checkout included)."""
    found = _read_source()
    return dict(found) if found is not None else None


@functools.lru_cache(maxsize=None)
def _read_source() -> Optional[dict]:
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != ROOT:
        return None
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "uncommitted_changes": dirty, "commit_date": _git("show", "-s", "--format=%cI", commit)}


def source_label(source: Optional[dict]) -> str:
    """A source in a word: the commit's first 12 characters, "+changes" when the tree differed; "unknown"."""
    if not source or not source.get("commit"):
        return "unknown"
    return source["commit"][:12] + ("+changes" if source.get("uncommitted_changes") else "")
