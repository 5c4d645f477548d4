"""The code's structure: imports run downward only, and parallel set-ups release what they open."""

import ast
import os
from pathlib import Path

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[1]

# What each part of the library may import (besides itself and third-party packages). From the bottom:
# config (the schemas), compat, launch, parallel, source (foundation); ops; data, and data_prep over it (oryx-prep's library;
# both know no model); mixer (the one mixer core: plain torch); run_config (oryx-train's schema); checkpoint (checkpoint
# files); layers (megatron holders) <- models <- {training, inference}; hf (the transformers front end) over the
# core, the schema and the data layer's mode vocabulary only, no megatron; eval; interop (checkpoint files to and from other formats); experiments and
# checks (harnesses, out of the runtime path); cli on top (nothing imports the console scripts).
FOUNDATION = {"config", "compat", "launch", "parallel", "source"}
BELOW_MODELS = {"layers", "mixer", "ops", "data", "run_config", "checkpoint"} | FOUNDATION
ALLOWED = {
    "ops": set(),
    "config": set(),
    "compat": set(),
    "launch": set(),
    "source": set(),
    "parallel": {"compat", "launch"},
    "data": {"config"},
    "data_prep": {"config", "data"},  # oryx-prep's library: the tokenizers and the shard writer
    "mixer": {"ops", "config"},
    "run_config": {"config", "data", "mixer"},
    "checkpoint": {"compat", "config", "run_config"},
    "layers": {"mixer", "ops", "config"},
    "models": {"layers", "mixer", "ops", "run_config"} | FOUNDATION,  # params sets up parallel state; compat
    "training": {"models"} | BELOW_MODELS,
    "inference": {"models", "data_prep"} | BELOW_MODELS,  # loading.py: a dataset's tokenizer
    "hf": {"mixer", "config", "data"},  # the core, the schema, the mode vocabulary: no megatron (an exported folder)
    "eval": {"inference", "training", "models"} | BELOW_MODELS,
    "interop": {"hf", "inference", "training", "models"} | BELOW_MODELS,
    "experiments": {"eval", "inference", "training", "models"} | BELOW_MODELS,
    "checks": {"interop", "hf", "eval", "inference", "training", "models"} | BELOW_MODELS,
    "cli": {"experiments", "checks", "interop", "hf", "eval", "inference", "training", "models", "data_prep"}
           | BELOW_MODELS,
}


def _part(module: str) -> str:
    """'oryx_megatron.data.loader' -> 'data'."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: Path, package: str):
    """(line, imported module) for every import in a file of ``package``, function-level ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            yield node.lineno, ".".join(base + ([node.module] if node.module else []))


# Where the package's modules lie in the checkout: oryx_megatron/, and the top-level folders that pyproject.toml's
# package-dir maps into it.
SOURCES = {"oryx_megatron": "oryx_megatron", "oryx_megatron.data_prep": "data_prep",
           "oryx_megatron.recipes": "recipes"}


def package_files(root: Path = ROOT):
    """(path, dotted module name) for each .py file of the package under root, in the order of the paths."""
    files = [(path, ".".join([package, *path.relative_to(root / folder).with_suffix("").parts]))
             for package, folder in SOURCES.items() for path in (root / folder).rglob("*.py")]
    return sorted(files)


def upward_imports(root: Path = ROOT):
    """'file:line imports module' for each import under root that runs up the layers."""
    found = []
    for path, name in package_files(root):
        rel = path.relative_to(root)
        package = name.rpartition(".")[0]  # the package the file belongs to
        source = _part(name)
        for line, module in _imports(path, package):
            if module is None or not module.startswith("oryx_megatron"):
                continue
            target = _part(module)
            ok = target in ("", source) or target in ALLOWED.get(source, set())
            if not ok:
                found.append(f"{rel}:{line} imports {module}")
    return found


def test_imports_run_downward_only():
    assert upward_imports() == []


def test_the_import_check_sees_upward_imports(tmp_path):
    files = {
        "oryx_megatron/data/probe.py": "import torch\ndef f():\n    from oryx_megatron.eval import ppl\n",
        "oryx_megatron/layers/probe.py": "from ..models import builder\nfrom ..ops import conv\n",
        "oryx_megatron/models/probe.py": "from oryx_megatron.layers import norms\n",
        "data_prep/probe.py": "from oryx_megatron.training import config\nfrom oryx_megatron.data import shards\n"
                              "from .tokenizer import ByteTokenizer\nfrom ..models import builder\n",
        "oryx_megatron/training/probe.py": "from oryx_megatron.data_prep.tokenizer import ByteTokenizer\n",
        "oryx_megatron/eval/probe.py": "from oryx_megatron.cli.errors import one_line\n",
        "oryx_megatron/experiments/probe.py": "from oryx_megatron.hf import convert\nfrom oryx_megatron.eval import ppl\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert upward_imports(tmp_path) == [
        "data_prep/probe.py:1 imports oryx_megatron.training",
        "data_prep/probe.py:4 imports oryx_megatron.models",
        "oryx_megatron/data/probe.py:3 imports oryx_megatron.eval",
        "oryx_megatron/eval/probe.py:1 imports oryx_megatron.cli.errors",
        "oryx_megatron/experiments/probe.py:1 imports oryx_megatron.hf",
        "oryx_megatron/layers/probe.py:1 imports oryx_megatron.models",
        "oryx_megatron/training/probe.py:1 imports oryx_megatron.data_prep.tokenizer",
    ]



def test_the_mixer_core_imports_neither_megatron_nor_transformers():
    """The one mixer core is plain torch: both front ends (megatron, transformers) import it, not it them."""
    import subprocess
    import sys

    code = ("import sys, oryx_megatron.mixer, oryx_megatron.config; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'transformers', 'omegaconf'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_hugging_face_front_end_imports_no_megatron():
    """An exported folder loads with torch and transformers alone: the HF front end, its model built and run,
    imports no megatron module (nor omegaconf, the recipes' schema library)."""
    import subprocess
    import sys

    code = ("import sys, torch, oryx_megatron.hf as hf; "
            "c = hf.OryxHFConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, "
            "intermediate_size=64, mixers='attention+gdn'); "
            "hf.OryxForCausalLM(c)(torch.zeros(1, 4, dtype=torch.long), modes='linear'); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'omegaconf'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_hugging_face_front_end_holds_no_mixing_math():
    """hf/ holds what transformers asks of a model; the mixing is the core's (it imports no ops)."""
    assert [f"{path.name}:{line} imports {module}" for path in sorted((ROOT / "oryx_megatron/hf").rglob("*.py"))
            for line, module in _imports(path, "oryx_megatron.hf") if module.startswith("oryx_megatron.ops")] == []

# Where megatron-core's version may be read: the compatibility module (which detects features instead), and the
# checks' provenance (the GPU check's and the GPU session's headers), which reports every package's installed
# version and decides nothing by it.
VERSION_READERS = {"oryx_megatron/compat/megatron.py", "oryx_megatron/checks/provenance.py"}
_VERSION_ATTRIBUTES = {"__version__", "__shortversion__", "package_info"}
_DISTRIBUTION_NAMES = {"megatron-core", "megatron_core"}  # what a package-metadata look-up names


def _dotted(node) -> str:
    """'megatron.core.__version__' for that attribute chain; '' for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    return f"{_dotted(node.value)}.{node.attr}" if isinstance(node, ast.Attribute) and _dotted(node.value) else ""


def megatron_version_reads(root: Path = ROOT):
    """'file:line' for each read of megatron-core's version outside VERSION_READERS, in the package's folders and
    benchmarks/: its ``__version__`` / ``package_info`` (an attribute, also through an import alias, or an import)
    or its distribution's name (``importlib.metadata.version("megatron-core")``)."""
    found = []
    for path in sorted(p for part in (*SOURCES.values(), "benchmarks") for p in (root / part).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in VERSION_READERS:
            continue
        tree = ast.parse(path.read_text(), rel)
        megatron_names = {"megatron"}  # names bound to megatron modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                megatron_names |= {a.asname for a in node.names if a.asname and a.name.startswith("megatron")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                megatron_names |= {a.asname or a.name for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                reads = node.attr in _VERSION_ATTRIBUTES and _dotted(node.value).split(".")[0] in megatron_names
            elif isinstance(node, ast.Import):
                reads = any(a.name.startswith("megatron") and a.name.endswith(".package_info") for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                reads = (node.module or "").startswith("megatron") and (
                    node.module.endswith(".package_info") or any(a.name in _VERSION_ATTRIBUTES for a in node.names))
            else:
                reads = isinstance(node, ast.Constant) and str(node.value).lower() in _DISTRIBUTION_NAMES
            if reads:
                found.append((rel, node.lineno))
    return [f"{rel}:{line} reads megatron-core's version" for rel, line in sorted(found)]


def test_only_the_compat_module_reads_megatron_cores_version():
    assert megatron_version_reads() == []


def test_the_version_check_sees_every_way_of_reading_it(tmp_path):
    files = {
        "oryx_megatron/models/probe.py": "import megatron.core\nv = megatron.core.__version__\n",
        "oryx_megatron/training/probe.py": "from megatron.core import package_info\nimport megatron.core as mc\n"
                                           "v = mc.__version__\n",
        "benchmarks/probe.py": "import importlib.metadata\nv = importlib.metadata.version('Megatron-Core')\n",
        "data_prep/probe.py": "from megatron.core.package_info import __version__\nimport megatron.core.package_info\n",
        "oryx_megatron/ops/probe.py": '"""Runs on megatron-core."""\nimport megatron.core.tensor_parallel\nx = t.__version__\n',
        "oryx_megatron/compat/megatron.py": "import megatron.core\nv = megatron.core.__version__\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert megatron_version_reads(tmp_path) == [f"{where} reads megatron-core's version" for where in (
        "benchmarks/probe.py:2", "data_prep/probe.py:1", "data_prep/probe.py:2",
        "oryx_megatron/models/probe.py:2", "oryx_megatron/training/probe.py:1", "oryx_megatron/training/probe.py:3")]


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _repeated_set_ups(layouts):
    """Thread counts after each set-up of the given TP sizes."""
    from oryx_megatron.parallel import initialize_parallel

    counts = []
    for seed, tp in enumerate(layouts):
        initialize_parallel(tensor_model_parallel_size=tp, seed=seed)
        counts.append(_threads())
    return counts


def _alternating_layouts_release_threads():
    """Once both layouts were set up, not one thread more (measured: the same count after each of 8)."""
    counts = _repeated_set_ups([1, 2, 1, 2, 1, 2])
    assert max(counts[1:]) == counts[1], f"threads after each set-up: {counts}"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_repeated_set_ups_in_one_process_add_no_threads(single_process_parallel):
    """Not one thread more after any set-up past the first (measured: the same count after each of 8)."""
    counts = _repeated_set_ups([1] * 6)
    assert max(counts) == counts[0], f"threads after each set-up: {counts}"


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through /proc")
def test_changing_layouts_destroys_the_old_groups():
    run_distributed(_alternating_layouts_release_threads)
