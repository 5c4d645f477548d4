"""Mixer plugins as their authors ship them: each folder here is a distribution of its own (a pyproject.toml and a
package, no file of the tests imported), installed with pip into a temporary target for the test session
(``install``) and found through its entry point (``oryx_megatron.mixers``), as every command finds it."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
PLUGINS = ("oryx-lanorm",)  # normalized linear attention: a state of two tensors, S [h, d_k, d_v] and z [h, d_k]


def install(target: Path, plugin: Optional[str] = None) -> None:
    """pip-installs every plugin here, or the one at ``plugin`` (a path: a plugin's own repository, ``make proofs
    PLUGIN=``) in their place, into ``target`` (built from a copy: nothing is written beside the sources) and puts
    ``target`` on the path of this process and of every process it starts."""
    sources = [Path(plugin).resolve()] if plugin else [HERE / name for name in PLUGINS]
    with tempfile.TemporaryDirectory() as build:
        for source in sources:
            copy = shutil.copytree(source, Path(build) / source.name, ignore=shutil.ignore_patterns(".git", ".venv"))
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "--target", str(target), str(copy)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
