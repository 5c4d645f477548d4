"""An exported folder carries its code (oryx_megatron/hf/remote_code.py): its modules import neither oryx_megatron
nor megatron, transformers' remote-code check accepts them without the optional kernel packages, config.json
records their hash, and in a Python that has torch and transformers only (transformers 5.16, vLLM's range, and
5.25; ``make hf-envs`` builds them once under ~/.cache) every family's logits equal the megatron model's within
1e-5 under every schedule, the parallel forward and cached decoding; saved again there, every folder keeps its
code."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers.dynamic_module_utils import check_imports, get_imports, get_relative_import_files  # noqa: E402

from oryx_megatron.config.plugins import mixer_plugins  # noqa: E402
from oryx_megatron.data.schedules import as_inference_schedule  # noqa: E402
from oryx_megatron.hf.remote_code import code_hash, model_code  # noqa: E402
from oryx_megatron.inference.forward import cached_logits  # noqa: E402
from tests.test_hf import SCHEDULES, converted, megatron_model, tiny_args  # noqa: E402

# and attention with each installed mixer plugin's mixer (the tests' plugin's lanorm: tests/plugins)
FAMILIES = ("oryx_tg", "oryx_tm", "gdn", "mamba2", *(f"attention+{mixer}" for plugin in mixer_plugins().values()
                                                     for mixer in plugin.mixers))
LANORM = {"lanorm": "oryx_lanorm:PLUGIN"}
HF_ENVS = Path(os.environ.get("ORYX_HF_ENVS", Path.home() / ".cache" / "oryx-megatron" / "hf-envs"))
TRANSFORMERS = ("5.16.1", "5.25.0")  # the Makefile's HF_ENV_VERSIONS
PROMPT, LENGTH = 40, 48
CHILD = Path(__file__).with_name("hf_folder_child.py")


@pytest.fixture(scope="module")
def exported(single_process_parallel, one_thread, tmp_path_factory):
    """Each family's folder and the megatron model's logits per schedule: (cases, references)."""
    root = tmp_path_factory.mktemp("folders")
    torch.manual_seed(0)
    cases, references = [], []
    for family in FAMILIES:
        megatron = megatron_model(tiny_args(family))
        folder = root / family
        converted(megatron, tiny_args(family)).save_pretrained(folder)
        ids = torch.randint(0, 256, (2, LENGTH))
        for schedule in SCHEDULES:
            modes = torch.from_numpy(as_inference_schedule(schedule).position_modes(PROMPT, LENGTH)).long()
            modes = modes.expand(2, -1).contiguous()
            with torch.no_grad():
                caches = megatron.allocate_inference_cache(2, torch.float32)
                steps = [cached_logits(megatron, ids[:, :PROMPT], modes[:, :PROMPT], caches)]
                steps += [cached_logits(megatron, ids[:, t:t + 1], modes[:, t:t + 1], caches)
                          for t in range(PROMPT, LENGTH)]
                references.append({"parallel": megatron(ids, modes), "cached": torch.cat(steps, dim=1)})
            cases.append({"folder": str(folder), "family": family, "schedule": schedule, "ids": ids,
                          "modes": modes, "prompt": PROMPT})
    return cases, references


def code_files(folder: Path):
    return {path.name: path.read_text() for path in sorted(folder.glob("*.py"))}


def test_the_folders_code_needs_torch_and_transformers_only(exported):
    folder = Path(exported[0][0]["folder"])
    files = code_files(folder)
    assert files == model_code() and {"modeling_oryx.py", "configuration_oryx.py"} <= set(files)
    for name, code in files.items():
        for node in ast.walk(ast.parse(code)):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            assert not [m for m in modules if m.split(".")[0] in ("oryx_megatron", "megatron")], (name, modules)
        libraries = set(get_imports(folder / name)) - set(sys.stdlib_module_names)
        assert libraries <= {"torch", "transformers", "numpy"}, (name, libraries)
    # transformers copies a folder's modules through their relative imports: every file is reached from auto_map's
    reached = {Path(f).name for entry in ("modeling_oryx.py", "configuration_oryx.py")
               for f in get_relative_import_files(folder / entry)}
    assert reached | {"modeling_oryx.py"} == set(files)
    with pytest.raises(ImportError):
        __import__("fla")  # the optional kernels are not installed here, and the check accepts their absence
    check_imports(folder / "modeling_oryx.py")
    config = json.loads((folder / "config.json").read_text())
    assert config["oryx"]["code_sha256"] == code_hash(files)
    assert config["auto_map"] == {"AutoConfig": "configuration_oryx.OryxHFConfig",
                                  "AutoModelForCausalLM": "modeling_oryx.OryxForCausalLM"}


@pytest.mark.skipif("lanorm" not in mixer_plugins(), reason="the tests' plugin is not installed: this session's "
                                                           "plugin is another's (make proofs PLUGIN=)")
def test_a_plugins_mixer_travels_with_its_modules(exported):
    """The folder of the plugin's mixer carries the plugin's module (flat, its imports of the core rewritten) and
    its config/plugins.py imports it; the hash covers it. Its logits: the test below."""
    folder = Path(next(case["folder"] for case in exported[0] if case["family"] == "attention+lanorm"))
    files = code_files(folder)
    assert files == model_code(LANORM) and set(files) - set(model_code()) == {"oryx_plugin_oryx_lanorm.py"}
    assert "    from .oryx_plugin_oryx_lanorm import PLUGIN as plugin_0\n" in files["oryx_config_plugins.py"]
    assert set(get_imports(folder / "oryx_plugin_oryx_lanorm.py")) - set(sys.stdlib_module_names) == {"torch"}
    assert json.loads((folder / "config.json").read_text())["oryx"]["code_sha256"] == code_hash(files)


def test_a_plugin_module_that_imports_more_than_torch_is_refused(tmp_path, monkeypatch):
    (tmp_path / "needs_numpy.py").write_text("import numpy\nfrom oryx_megatron.config import MixerPlugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^mixer plugin module needs_numpy imports 'numpy': an exported folder "
                                         r"carries torch, the standard library, oryx-megatron's core and the plugin "
                                         r"alone$"):
        model_code({"needs": "needs_numpy:PLUGIN"})


def test_a_mixer_from_outside_the_package_and_its_plugins_is_refused_at_save(single_process_parallel, tmp_path):
    megatron = megatron_model(tiny_args("attention+gla"))
    with pytest.raises(ValueError, match=r"OryxHFConfig.mixers='attention\+gla': GatedLinearAttention "
                                         r"\(tests.mixers.gla\) is neither a module of oryx-megatron nor a mixer "
                                         r"plugin's, so a saved folder cannot carry its code"):
        converted(megatron, tiny_args("attention+gla")).save_pretrained(tmp_path / "gla")


@pytest.mark.parametrize("version", TRANSFORMERS)
def test_logits_equal_megatrons_where_only_transformers_is_installed(exported, version, tmp_path):
    python = HF_ENVS / f"transformers-{version}" / "bin" / "python"
    if not (python.parent.parent / ".installed").exists():
        pytest.fail(f"no Python with transformers {version} at {python.parent.parent}: run `make hf-envs`")
    cases, references = exported
    torch.save(cases, tmp_path / "cases.pt")
    subprocess.run([str(python), "-I", str(CHILD), str(tmp_path / "cases.pt"), str(tmp_path / "result.pt"),
                    str(tmp_path / "resaved")], cwd=tmp_path, check=True, timeout=600,
                   env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})
    result = torch.load(tmp_path / "result.pt")
    assert result["transformers"] == version and result["model_module"].startswith("transformers_modules.")
    for case, want, got in zip(cases, references, result["results"]):
        assert (got["family"], got["schedule"]) == (case["family"], case["schedule"])
        for path in ("parallel", "cached"):
            error = (got[path] - want[path]).abs().max().item()
            assert error <= 1e-5, (case["family"], case["schedule"], path, error)
    for i, folder in enumerate(map(Path, result["folders"])):  # saved from the folder: the same code, same hash
        resaved = tmp_path / "resaved" / str(i)
        assert code_files(resaved) == code_files(folder), folder.name
        assert (json.loads((resaved / "config.json").read_text())["oryx"]["code_sha256"]
                == json.loads((folder / "config.json").read_text())["oryx"]["code_sha256"]), folder.name
