"""The package works installed from a wheel: built from this checkout, installed without its dependencies
into a fresh target outside the repo, then its console scripts run from another directory (oryx-params,
oryx-prep tokenize on a small text file, oryx-train on synthetic data) with modules and recipes from that
target only."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from oryx_megatron.checkpoint import load_common
from tests.test_structure import SOURCES

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_oryx_tg", "model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.kv_channels=16", "model.ffn_hidden_size=128", "model.linear_chunk_size=16"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, the --target it is installed into). Built from a copy of the checkout's files (tracked, and
    untracked but not ignored): setuptools' build/ folder of the checkout may hold modules deleted since."""
    root = tmp_path_factory.mktemp("wheel")
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout.split()
    for name in listed:
        if (REPO / name).is_file():
            (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / "src" / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(root / "src")],
                   check=True, capture_output=True, timeout=300, cwd=root)
    wheel, = (root / "dist").glob("oryx_megatron-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(root / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300, cwd=root)
    return wheel, root / "site"


def checkout_files():
    """The name in the wheel of each module and recipe of the checkout: oryx_megatron/, and the top-level recipes/
    and data_prep/ inside it (pyproject.toml's package-dir)."""
    return sorted("/".join([*package.split("."), *path.relative_to(REPO / folder).parts])
                  for package, folder in SOURCES.items() for path in (REPO / folder).rglob("*")
                  if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts)


def test_the_wheel_holds_the_recipes_and_one_top_level_package(installed):
    wheel, _ = installed
    names = zipfile.ZipFile(wheel).namelist()
    assert {"oryx_megatron/recipes/train.yaml", "oryx_megatron/recipes/model/tiny_oryx_tg.yaml",
            "oryx_megatron/recipes/experiment/base/mqar.yaml", "oryx_megatron/data_prep/pipeline.py",
            "oryx_megatron/cli/train.py"} <= set(names)
    # every module and recipe, and no other (a package missing from pyproject.toml's list would be left out)
    assert sorted(name for name in names if name.endswith((".py", ".yaml"))) == checkout_files()
    # neither recipes nor data_prep is a top-level name in site-packages
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"oryx_megatron"}


def test_the_installed_commands_run_from_another_directory(installed, tmp_path):
    _, site = installed
    env = {**os.environ, "PYTHONPATH": str(site), "TORCHDYNAMO_DISABLE": "1", "WANDB_MODE": "disabled",
           "PYTHONWARNINGS": "ignore"}
    (tmp_path / "corpus.txt").write_text("def main():\n    return 42\n" * 200)
    bin_dir = site / "bin"
    commands = {
        "where": [sys.executable, "-c", "import oryx_megatron, oryx_megatron.data_prep as prep, oryx_megatron.source "
                  "as source; print(oryx_megatron.RECIPES_DIR); print(prep.__file__); print(source.git_source())"],
        "params": [bin_dir / "oryx-params", "model=tiny_oryx_tg"],
        "prep": [bin_dir / "oryx-prep", "tokenize", "corpus.txt", "--tokenizer", "byte", "--out", "data",
                 "--workers", "1"],
        "train": [bin_dir / "oryx-train", *TINY, "data=mqar", "data.seq_length=64", "model.vocab_size=64",
                  "train.train_iters=2", "train.micro_batch_size=2", "train.global_batch_size=2",
                  "train.eval_interval=null", "optimizer.lr_warmup_iters=1", "checkpoint.dir=ckpt",
                  "checkpoint.save_at_end=true", "logging.wandb_mode=disabled", "hydra.run.dir=run"],
    }
    running = {name: subprocess.Popen([str(a) for a in argv], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
               for name, argv in commands.items()}  # the machine's cores share the imports
    out = {}
    for name, process in running.items():
        out[name] = process.communicate(timeout=300)[0]
        assert process.returncode == 0, f"{name}: {out[name]}"
    assert out["where"].split() == [str(site / "oryx_megatron" / "recipes"),  # not the checkout's
                                    str(site / "oryx_megatron" / "data_prep" / "__init__.py"), "None"]  # no checkout
    assert "total_params=" in out["params"] and "shared_fraction=" in out["params"]
    assert (tmp_path / "data" / "manifest.json").is_file() and "1 shards" in out["prep"]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000002"
    assert load_common(tmp_path / "ckpt" / "iter_0000002")["source"] is None  # trained by no checkout's code
    assert (tmp_path / "run" / "loss_curve.png").is_file()
