"""Result files the tools and benchmarks rewrite as they go."""

import json
from pathlib import Path


def write_json(path, data) -> None:
    """Replace ``path`` with ``data`` as JSON atomically: a reader, or a kill mid-write, never sees half a
    file (the benchmarks rewrite theirs after every row, so a run cut short keeps what it measured)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    tmp.replace(path)
