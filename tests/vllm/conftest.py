"""tests/vllm run in vLLM's venv only (`make test-vllm`); the main suite, whose venv has no vLLM, skips the folder.
The folders and oryx-generate's tokens come from the project's venv (make_folder.py), once per session."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["*.py"]

ROOT = Path(__file__).parents[2]
PROJECT_PYTHON = Path(os.environ.get("ORYX_PROJECT_PYTHON", ROOT / ".venv" / "bin" / "python"))


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """(root of one folder per family, expected.json's content)."""
    root = tmp_path_factory.mktemp("folders")
    subprocess.run([str(PROJECT_PYTHON), str(Path(__file__).with_name("make_folder.py")), str(root)], cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True, stdout=subprocess.DEVNULL)
    return root, json.loads((root / "expected.json").read_text())
