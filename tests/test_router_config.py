"""The router's hyperparameters in one schema (config/router.py, the run's ``router`` group): the former recipe keys
``model.router_hidden``, ``model.router_chunk_size``, ``model.router_layers`` are aliases of ``router.hidden``,
``router.chunk_size``, ``router.layers`` on the command line, in a saved run config and in a recipe built alone; an
alias and its key that disagree are one line."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from oryx_megatron import RECIPES_DIR
from oryx_megatron.config import RouterConfig
from oryx_megatron.inference.checkpoint import load_model
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.run_config import ConfigError, load_train_config
from tests.helpers import tiny_args
from tests.test_train import TINY_MODEL, TINY_TRAIN

LEGACY = Path(__file__).parent / "fixtures" / "legacy_3486e45" / "oryx_tg" / "ckpt"
KEYS = {"hidden": 64, "chunk_size": 16, "layers": 2}
ALIASES = {"hidden": "router_hidden", "chunk_size": "router_chunk_size", "layers": "router_layers"}


def run_config(*overrides):
    with initialize_config_dir(str(RECIPES_DIR), version_base=None):
        cfg = compose("train", overrides=[*TINY_MODEL, *TINY_TRAIN, "data=mqar", "train.train_iters=1",
                                          "checkpoint.dir=null", *overrides])
    return load_train_config(cfg)


def test_the_former_model_keys_give_the_routers_keys():
    new = run_config(*(f"router.{key}={value}" for key, value in KEYS.items()))
    old = run_config(*(f"model.{ALIASES[key]}={value}" for key, value in KEYS.items()))
    assert new == old and (new.router.hidden, new.router.chunk_size, new.router.layers) == (64, 16, 2)
    assert (old.model.router_hidden, old.model.router_chunk_size, old.model.router_layers) == (None, None, None)
    assert run_config("model.router_hidden=64").router == RouterConfig(hidden=64, chunk_size=128, layers=1)
    assert run_config().router == RouterConfig() and RouterConfig().hidden is None  # no router
    assert run_config("model.router_hidden=64", "router.hidden=64").router.hidden == 64  # both, agreeing
    # the run saved and read back: the router's keys only
    saved = OmegaConf.to_yaml(OmegaConf.structured(old))
    assert "router_hidden: null" in saved and load_train_config(OmegaConf.create(saved)) == old


@pytest.mark.parametrize("key,value,alias_value", [("hidden", 32, 64), ("chunk_size", 128, 16), ("layers", 1, 2)])
def test_an_alias_and_its_key_that_disagree_are_one_line(key, value, alias_value):
    """router.chunk_size=128 and router.layers=1 are their defaults, given: an alias beside them still disagrees."""
    alias = ALIASES[key]
    with pytest.raises(ConfigError) as error:
        run_config("router.hidden=8", f"router.{key}={value}", f"model.{alias}={alias_value}")
    assert str(error.value) == (f"config key 'router.{key}': router.{key}={value} and its alias "
                                f"model.{alias}={alias_value} disagree: give one of them")


def test_the_router_is_checked_against_the_model_by_the_key_given():
    with pytest.raises(ConfigError) as error:
        run_config("model.family=gdn", "router.hidden=8")
    assert str(error.value) == ("config key 'router.hidden': router.hidden=8: a router chooses between two mixers, "
                                "got mixers='gdn'")
    with pytest.raises(ConfigError) as error:
        run_config("router.hidden=8", "router.layers=3")
    assert str(error.value) == "config key 'router.layers': router.layers=3 exceeds the model's num_layers=2"
    with pytest.raises(ValueError) as error:  # a recipe built alone: its alias named
        transformer_config(tiny_args(router_hidden=8, router_chunk_size=0))
    assert str(error.value) == "model.router_chunk_size=0 must be a positive integer"


def test_a_checkpoint_written_with_the_former_keys_loads_its_router(single_process_parallel):
    """tests/fixtures/legacy_3486e45: model.router_hidden: 8, model.router_chunk_size: 128 in its run_config.yaml."""
    assert "  router_hidden: 8" in (LEGACY / "iter_0000001" / "run_config.yaml").read_text()
    model, run = load_model(str(LEGACY))
    assert run.router == RouterConfig(hidden=8, chunk_size=128, layers=1) and run.model.router_hidden is None
    assert model.router.fc1.weight.shape[0] == 8 and model.config.router.chunk_size == 128  # [hidden, features]


def test_a_recipe_built_alone_takes_its_router_from_the_aliases(single_process_parallel):
    args = tiny_args(router_hidden=8, router_chunk_size=4, router_layers=2)
    config = transformer_config(args, params_dtype=torch.float32)
    assert config.router == RouterConfig(hidden=8, chunk_size=4, layers=2)
    model = build_model(args, config)
    assert model.router.fc1.weight.shape == (8, 4 * 2 * 2 * 16)  # hidden, heads x layers x two reads x d_v
    with pytest.raises(ValueError, match=r"model.router_hidden=8 beside a run's router group: give router.hidden"):
        transformer_config(args, RouterConfig(hidden=8))


def test_a_routed_model_travels_through_a_hugging_face_folder_with_its_router(corpus, single_process_parallel, tmp_path):
    """Exported, the router's keys are the HF config's router_hidden, router_chunk_size, router_layers; imported, the
    run's router group again, the router's weights bit for bit."""
    import json

    from oryx_megatron.interop.hf_export import export_model
    from oryx_megatron.interop.hf_import import import_checkpoint
    from oryx_megatron.training.builders import model_config
    from tests.test_train import run_config as corpus_run_config

    run = corpus_run_config(corpus, tmp_path / "run", "router.hidden=8", "router.chunk_size=16", "router.layers=2")
    torch.manual_seed(0)
    model = build_model(run.model, model_config(run))
    with torch.no_grad():  # none of them at its initial value (fc2: zeros, calibration: NaN, price: 0)
        model.router.fc2.weight.normal_()
        model.router.calibration.copy_(torch.linspace(0, 1, 101, dtype=torch.float64))
        model.router.price.fill_(0.25)
    export_model(model, run, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["router_hidden"], config["router_chunk_size"], config["router_layers"]) == (8, 16, 2)
    imported, imported_run = load_model(str(import_checkpoint(tmp_path / "hf", tmp_path / "ckpt")))
    assert imported_run.router == run.router
    want = {k: v for k, v in model.state_dict().items() if k.startswith("router.") and torch.is_tensor(v)}
    got = imported.state_dict()
    assert len(want) == 6 and all(torch.equal(got[k], want[k]) for k in want)  # fc1, fc2, calibration, price
