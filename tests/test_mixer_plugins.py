"""Mixer plugins (oryx_megatron/config/plugins.py): a distribution of its own registers a linear mixer, its ops and
its layer-pattern letter through the entry point group ``oryx_megatron.mixers``, and every command finds it with no
launcher. The tests' plugin (tests/plugins/oryx-lanorm: linear attention with a normalizer, a state of two tensors
of different shapes) is pip-installed into a temporary target for the session (tests/conftest.py); the proofs of
every registered mixer run for it by themselves (``pytest -k lanorm``). Here: what it registers, its two-tensor
state through every cache path, the plugin errors, and commands that see it."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from oryx_megatron.checkpoint import CONFIG, latest_name
from oryx_megatron.config.pattern import layer_letters, layer_mixers
from oryx_megatron.config.plugins import PluginError
from oryx_megatron.mixer import linear_mixers
from oryx_megatron.ops import OPS, get_kernels
from tests import plugins
from tests.helpers import build_mixer, mix
from tests.processes import run_cli
from tests.test_multi_mixer import B, hidden_states, random_modes
from tests.test_train import TINY_MODEL, TINY_TRAIN

MIXERS = "attention+lanorm"


def test_the_plugin_registers_its_mixer_ops_and_letter_from_its_installed_distribution(pytestconfig):
    mixer = linear_mixers()["lanorm"]
    origin = Path(sys.modules[mixer.__module__].__file__)
    assert (mixer.__module__, origin.parent.parent) == ("oryx_lanorm", pytestconfig.plugin_target)
    assert get_kernels("torch").names["chunk_lanorm"] == "torch"
    assert OPS["lanorm_step"].torch.__module__ == "oryx_lanorm"
    assert layer_letters()["N"] == "lanorm" and layer_mixers("ON*", MIXERS) == (MIXERS, "lanorm", "attention")


@pytest.mark.usefixtures("single_process_parallel")
def test_its_state_of_two_tensors_is_allocated_counted_and_reset_per_row():
    """S [b, h, d_k, d_v] and z [b, h, d_k], as its state_spec declares (fp64 here), allocated, counted by nbytes and
    zeroed per row by a document start. Prefill, decode, snapshots and packed documents: the proofs of every
    registered mixer (tests/test_multi_mixer.py, test_mixer_reads.py, test_documents.py: ``-k lanorm``)."""
    mixer = build_mixer("oryx", mixers=MIXERS)
    h, d = mixer.num_heads, mixer.d_k
    cache = mixer.allocate_inference_cache(B, torch.float64)
    assert {name: (tuple(t.shape), t.dtype) for name, t in cache.recurrent_state.items()} == {
        "S": ((B, h, d, d), torch.float64), "z": ((B, h, d), torch.float64)}
    assert cache.nbytes()["recurrent"] == B * h * (d * d + d) * 8
    mix(mixer, hidden_states(1), random_modes(1, chunk=4), cache)
    assert all(t.ne(0).all() for t in cache.recurrent_state.values())  # z > 0: a sum of positive features
    cache.start_documents(torch.tensor([True, False]))
    assert all(t[0].eq(0).all() and t[1].ne(0).all() for t in cache.recurrent_state.values())


def fake_plugins(root: Path, plugins: dict) -> Path:
    """A folder of installed distributions (dist-info with entry points) whose modules are ``plugins``' sources."""
    for name, source in plugins.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
        info = root / f"{name}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[oryx_megatron.mixers]\n{name} = {name}:PLUGIN\n")
    return root


def oryx_params(path: Path, *overrides):
    """oryx-params in a new interpreter with ``path`` on its path (its entry points are read at its start)."""
    env = {**os.environ, "PYTHONPATH": str(path)}
    return subprocess.run([sys.executable, "-m", "oryx_megatron.cli.params", *TINY_MODEL, *overrides],
                          capture_output=True, text=True, env=env, timeout=300)


REUSES_LANORM = """
    import oryx_lanorm
    from oryx_megatron.config import MixerPlugin
    PLUGIN = MixerPlugin(mixers={"lanorm": oryx_lanorm.NormalizedLinearAttention})
"""


@pytest.mark.parametrize("plugins,error", [
    ({"broken": "import not_a_module\n"},
     "oryx-params: error: mixer plugin 'broken' (broken:PLUGIN) failed to import: ModuleNotFoundError: No module "
     "named 'not_a_module'"),
    ({"again": REUSES_LANORM},
     "oryx-params: error: mixer plugins 'again' and 'lanorm' both register the mixer 'lanorm'; uninstall one"),
], ids=["fails-to-import", "claims-a-taken-name"])
def test_a_bad_plugin_is_one_line_that_names_it(tmp_path, pytestconfig, plugins, error):
    path = f"{fake_plugins(tmp_path, plugins)}:{pytestconfig.plugin_target}"
    out = oryx_params(Path(path), "model.family=oryx_tg")
    assert (out.returncode, out.stderr.strip().splitlines()[-1:]) == (2, [error]), out.stderr


@pytest.fixture
def fresh_registry(tmp_path, monkeypatch):
    """The plugin loader and the linear mixers as a new process has them (nothing loaded), with ``install(sources)``
    as its installed plugins: name -> the source of its module (its entry point ``name:PLUGIN``)."""
    from importlib.metadata import EntryPoint

    from oryx_megatron.config import plugins
    from oryx_megatron.mixer import linear
    from oryx_megatron.ops import registry

    for module, name, value in ((plugins, "_LOADED", None), (plugins, "_REFUSED", None), (plugins, "IN_PACKAGE", True),
                                (linear, "_PLUGINS_ADDED", False), (linear, "LINEAR_MIXERS", dict(LINEAR_BUILT_IN)),
                                (registry, "OPS", dict(registry.OPS)), (plugins, "ENTRY_POINTS", {})):
        monkeypatch.setattr(module, name, value)
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(sources: dict):
        for name, source in sources.items():
            (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
            monkeypatch.delitem(sys.modules, name, raising=False)
        points = [EntryPoint(name, f"{name}:PLUGIN", plugins.GROUP) for name in sources]
        monkeypatch.setattr(plugins, "entry_points", lambda group: points if group == plugins.GROUP else [])

    return install


LINEAR_BUILT_IN = {name: mixer for name, mixer in linear_mixers().items() if mixer.__module__.startswith("oryx_")}

HALF_REGISTERED = {  # registers an op, then fails: importing it again would find its op declared
    "half": """
        from oryx_megatron.ops import KernelOp, register_op
        register_op(KernelOp("half_op", abs))
        raise RuntimeError("half-way")
    """,
    "second_bad": """
        import oryx_lanorm
        from oryx_megatron.config import MixerPlugin
        PLUGIN = MixerPlugin(mixers={"lanorm2": oryx_lanorm.NormalizedLinearAttention, "not_a_mixer": dict})
    """,
}


@pytest.mark.parametrize("plugin,error", [
    ("half", "mixer plugin 'half' (half:PLUGIN) failed to import: RuntimeError: half-way"),
    ("second_bad", "mixer plugin 'second_bad': mixer 'not_a_mixer' is <class 'dict'>, not a subclass of "
                   "oryx_megatron.mixer.LinearMixer"),
], ids=["import-fails-half-way", "second-mixer-refused"])
def test_a_plugin_refused_part_way_is_refused_again_with_the_same_line(fresh_registry, plugin, error):
    """Its first mixer is not left registered (no later "name taken"), and its module is not imported twice."""
    fresh_registry({plugin: HALF_REGISTERED[plugin]})
    for _ in range(2):
        with pytest.raises(PluginError) as refused:
            linear_mixers()
        assert str(refused.value) == error
    assert "lanorm2" not in linear_mixers.__globals__["LINEAR_MIXERS"]


def test_a_plugin_that_reads_the_registry_while_imported_is_refused_in_one_line(fresh_registry):
    fresh_registry({"reader": """
        from oryx_megatron.mixer import linear_mixers
        KNOWN = sorted(linear_mixers())
    """})
    with pytest.raises(PluginError) as refused:
        layer_letters()
    assert str(refused.value) == ("mixer plugin 'reader' reads the mixer registry while it is imported; read it in "
                                  "a function the plugin calls later")


def test_commands_see_the_plugin_with_no_launcher(tmp_path, corpus):
    """oryx-params counts a layer pattern with its letter; oryx-train trains the plugin's mixer and saves it with
    megatron's async writer (a forked process: it inherits the registry; docs/model.md, "Mixer plugins"), whose
    checkpoint oryx-generate decodes with a linear prefill and attention decode and oryx-eval scores; oryx-export
    writes its folder with the plugin's module (its logits where only transformers is installed:
    tests/test_hf_folder.py) and oryx-import reads it back."""
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.params", *TINY_MODEL, "model.family=oryx",
                   f"model.mixers={MIXERS}", "model.layer_pattern=ON"])
    assert out.returncode == 0 and "layer_pattern='ON': O=1 N=1" in out.stdout, out.stderr
    ckpt = tmp_path / "ckpt"
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.train", *TINY_MODEL, *TINY_TRAIN, "model.family=oryx",
                   f"model.mixers={MIXERS}", f"data.data_path=[{corpus['shards']}]", "train.train_iters=2",
                   "checkpoint.save_at_end=true",
                   "checkpoint.async_save=true", f"checkpoint.dir={ckpt}", f"hydra.run.dir={tmp_path / 'out'}"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert latest_name(str(ckpt)) == ckpt / "iter_0000002" and (ckpt / "iter_0000002" / CONFIG).exists()
    saves = [json.loads(row) for row in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in saves if "checkpoint/background_s" in row] == [2]  # the writer completed
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.evaluate", str(ckpt), "--task", "ppl", "--num-batches",
                   "1", "--batch-size", "2", "--out", str(tmp_path / "eval")])
    assert out.returncode == 0, out.stderr[-3000:]
    losses = {row["schedule"]: row["loss"] for row in json.loads((tmp_path / "eval" / "ppl.json").read_text())["rows"]}
    assert math.isfinite(losses["all_linear"]) and math.isfinite(losses["all_attention"]), losses
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.generate", str(ckpt), "--prompt", "def ",
                   "--schedule", "prefill=linear decode=attention", "--max-new-tokens", "4"])
    assert out.returncode == 0 and out.stdout.count("=== [") == 1, out.stderr[-3000:]
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.export_hf", "hf", str(ckpt), str(tmp_path / "hf")])
    assert out.returncode == 0 and (tmp_path / "hf" / "oryx_plugin_oryx_lanorm.py").exists(), out.stderr[-3000:]
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.import_hf", "hf", str(tmp_path / "hf"),
                   str(tmp_path / "back")])
    assert out.returncode == 0 and (tmp_path / "back" / "latest").exists(), out.stderr[-3000:]


def test_oryx_experiment_trains_and_evaluates_the_plugin_mixer(tmp_path):
    """A2's smoke configuration (MQAR: no corpus; its sweep of two learning rates, two variants, one seed) with the
    model's mixers overridden: every run it trains is the plugin's, and it tabulates the linear mixer's reads."""
    out = run_cli([sys.executable, "-m", "oryx_megatron.cli.experiment", "a2_sequence_mixing", "--smoke", "--seeds",
                   "1", "--out", str(tmp_path), "model.family=oryx", f"model.mixers={MIXERS}"], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    configs = sorted(tmp_path.glob("runs/*/checkpoints/iter_*/run_config.yaml"))
    assert len(configs) >= 2 and all(f"mixers: {MIXERS}\n" in path.read_text() for path in configs), configs
    results = json.loads((tmp_path / "a2_sequence_mixing" / "results.json").read_text())
    assert {(row["variant"], row["label"]) for row in results["summary"]} >= {("chunked", "all_linear"),
                                                                              ("sequence_level", "all_linear")}


ROOT = Path(__file__).resolve().parent.parent


def test_make_proofs_runs_a_plugins_proofs_from_its_own_repository(tmp_path):
    """docs/model.md's command, run in a plugin's repository: a copy of the tests' plugin whose mixer is renamed
    lanorm_b (registered by nothing else: the session's plugin target is left out of its path), narrowed to one
    cheap proof file. Every case it runs is lanorm_b's, and they pass. (-o: the venv and the transformers envs are
    the suite's, not remade; PY: this interpreter.)"""
    repo = shutil.copytree(plugins.HERE / "oryx-lanorm", tmp_path / "oryx-lanorm-b")
    for path, old, new in ((repo / "pyproject.toml", 'lanorm = "', 'lanorm_b = "'),
                           (repo / "oryx_lanorm" / "__init__.py", '"lanorm"', '"lanorm_b"')):
        assert old in path.read_text()
        path.write_text(path.read_text().replace(old, new))
    env = {key: value for key, value in os.environ.items()  # not this session's plugins, nor an outer make's flags
           if key not in ("PYTHONPATH", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-C", str(ROOT), "-o", ".venv/.installed", "-o", "hf-envs", "proofs",
                          "MIXER=lanorm_b", f"PLUGIN={repo}", "PROOFS=tests/test_mixer_reads.py",
                          f"PY={sys.executable}"], cwd=repo, env={**env, "PYTEST_ADDOPTS": "-rA -p no:cacheprovider"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = re.findall(r"^PASSED (\S+)", out.stdout, re.M)
    assert passed and all("lanorm_b" in case for case in passed), out.stdout[-3000:]
    assert re.search(rf"^{len(passed)} passed, \d+ deselected", out.stdout, re.M), out.stdout[-3000:]
