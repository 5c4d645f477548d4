"""Mixer plugins as their authors ship them: each folder here is a distribution of its own (a pyproject.toml and a
package, no file of the tests imported), installed with pip into a temporary target for the test session
(``install``) and found through its entry point (``oryx_megatron.mixers``), as every command finds it."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLUGINS = ("oryx-lanorm",)  # normalized linear attention: a state of two tensors, S [h, d_k, d_v] and z [h, d_k]


def install(target: Path) -> None:
    """pip-installs every plugin here into ``target`` (built from a copy: nothing is written beside the sources) and
    puts ``target`` on the path of this process and of every process it starts."""
    with tempfile.TemporaryDirectory() as build:
        for name in PLUGINS:
            source = shutil.copytree(HERE / name, Path(build) / name)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                            "--no-index", "--target", str(target), str(source)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
