"""Where a result came from: the source (commit, uncommitted changes) and the installed versions.

The GPU machine gets a copy of the working tree, maybe without ``.git``: the commit is stamped on the CPU
side before the call into ``.gpu/source.json`` (carried with ``.gpu/``) and read there.

    python -m oryx_megatron.checks.provenance      # -> .gpu/source.json (make gpu-stamp)
"""

import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import sys
from pathlib import Path
from typing import Dict, Sequence

from oryx_megatron.source import ROOT, git_source

STAMP = ROOT / ".gpu" / "source.json"
VERSIONS = {  # report name -> (distributions, module)
    "torch": (("torch",), "torch"),
    "triton": (("triton",), "triton"),
    "megatron-core": (("megatron-core",), "megatron.core"),
    "fla": (("flash-linear-attention", "fla-core"), "fla"),
    "mamba-ssm": (("mamba-ssm",), "mamba_ssm"),
    "causal-conv1d": (("causal-conv1d",), "causal_conv1d"),
    "transformer-engine": (("transformer-engine", "transformer_engine"), "transformer_engine"),
    "tilelang": (("tilelang",), "tilelang"),  # fla's GDN backward on Hopper without Triton >= 3.7.1
}


def package_version(distributions: Sequence[str], module: str) -> str:
    """The installed version, or one read from a source tree on the path (no metadata), or "not installed"."""
    for dist in distributions:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        if importlib.util.find_spec(module) is None:
            return "not installed"
        version = getattr(importlib.import_module(module), "__version__", "unknown")
        return f"{version} (source tree, no package metadata)"
    except Exception as e:  # a half-installed package raises more than ImportError
        return f"not importable: {type(e).__name__}: {e}"


def versions() -> Dict[str, str]:
    """Report name -> version of every package of VERSIONS. torch's keeps the build's local tag
    (2.11.0+cu130) that the metadata of PyPI's wheels lacks."""
    import torch

    return {name: torch.__version__ if name == "torch" else package_version(*where) for name, where in VERSIONS.items()}


def source(stamp: Path = STAMP) -> dict:
    """The source of this run: from git where ``.git`` is here, else from the stamp written before the
    call, else saying that neither was there."""
    found = git_source()
    if found is not None:
        return {**found, "from": "git"}
    try:
        return {**json.loads(stamp.read_text()), "from": str(stamp)}
    except (OSError, ValueError):
        return {"commit": None, "from": f"unknown: no .git and no {stamp} (make gpu-stamp before the call)"}


def write_stamp(stamp: Path = STAMP) -> dict:
    """Stamp the checkout's source into ``stamp`` (on the CPU side, before a GPU call)."""
    found = git_source()
    if found is None:
        raise SystemExit(f"{ROOT}: not a git checkout, nothing to stamp")
    found["stamped_at"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps(found, indent=1) + "\n")
    return found


if __name__ == "__main__":
    print(json.dumps(write_stamp()), file=sys.stdout)
