"""The chunk router's hyperparameters, declared once: ``RouterConfig``, the ``router:`` group of oryx-train's config
(docs/routing.md). Its architecture (``hidden``, ``chunk_size``, ``layers``: what a model with a router builds, and
the chunk a router schedule decides per) and its training (``mode``: post-hoc or joint, and their settings).

The recipe keys that held the architecture before, ``model.router_hidden``, ``model.router_chunk_size`` and
``model.router_layers``, are aliases (``ALIASES``): a run config or a checkpoint's run_config.yaml that gives them
loads to the same RouterConfig (``move_aliases``), and a model recipe built without a run (``ModelArgs`` alone:
oryx-params, a test's tiny recipe) takes its router from them (``model_router``).
"""

from dataclasses import dataclass, fields
from typing import Dict, MutableMapping, Optional

from oryx_megatron.config.mixer import MixerConfig
from oryx_megatron.config.model import ModelArgs
from oryx_megatron.config.pattern import ORYX_BLOCK, pattern_letters

# RouterConfig's architecture key -> its alias among the model recipe's keys (model.<alias>)
ALIASES = {"hidden": "router_hidden", "chunk_size": "router_chunk_size", "layers": "router_layers"}
# the architecture keys that may be left unset (None: their default; hidden's None is "no router"): oryx-train's schema
# leaves them so (run_config.py), that an alias given beside one be told apart from its default
UNSET = ("chunk_size", "layers")


class RouterConfigError(ValueError):
    """A bad router hyperparameter; ``key`` names it as it was given (``router.hidden``, ``model.router_hidden``)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass
class RouterConfig:
    """The chunk router of a multi-mixer model and its training: ``mode=posthoc`` fits the router of a trained,
    frozen model (training/router.py); ``mode=joint`` trains it with the model, the router choosing each chunk's mode
    (training/joint_routing.py); ``none``: ordinary pretraining (a model may still have a router: ``hidden``)."""

    hidden: Optional[int] = None
    """Width of the router's hidden layer (mixer/router.py); None: the model has no router. Multi-mixer only."""

    chunk_size: Optional[int] = 128
    """Tokens per router decision (a schedule may choose another); None: unset, the default."""

    layers: Optional[int] = 1
    """Layers whose two reads the router reads, from the first: 1, the first layer's, known before any mode; more,
    those of an all-linear pass (generation keeps its caches beside the model's); None: unset, the default."""

    mode: str = "none"  # "none" | "posthoc" | "joint"
    init_from: Optional[str] = None  # the trained model (a checkpoint or a run's checkpoint.dir); joint: optional
    objective: str = "classification"  # "classification" (targets at benefit_threshold) | "regression"
    benefit_threshold: float = 0.0  # nats: a chunk's target is attention where reading it lowers its mean loss more
    temperature: float = 0.1  # regression: the router's logit is fitted to (benefit - benefit_threshold) / temperature
    calibration_batches: int = 8  # held-out batches whose chunks calibrate the budget thresholds
    budget: float = 0.1  # joint: the fraction of tokens to read attention; its price adapts to hold it
    price_lr: float = 0.1  # joint: step of the budget's price (dual ascent on the share of p >= 0.5 - budget)
    # joint: the router's gradient: "straight_through" (the LM loss's derivative in the read's weight) or
    # "score_function" (REINFORCE: log P(drawn mode) x each token's loss and price, less the batch's mean there)
    estimator: str = "straight_through"

    def __post_init__(self):
        for f in fields(self):
            if f.name in UNSET and getattr(self, f.name) is None:
                setattr(self, f.name, f.default)


KEYS = {key: f"router.{key}" for key in ALIASES}  # how check_router names the keys of a run's router group


def move_aliases(tree: MutableMapping) -> MutableMapping:
    """``tree``, a run config as nested mappings (composed by Hydra, or a saved run_config.yaml), with each alias it
    gives (``model.router_hidden``, ...: not null) moved to its key in the router group, in place; RouterConfigError
    when an alias and its key are both given and differ."""
    model = tree.get("model") or {}
    for key, alias in ALIASES.items():
        value = model.pop(alias, None)
        if value is None:
            continue
        if tree.get("router") is None:  # no router group of its own (an old run config)
            tree["router"] = {}
        router = tree["router"]
        given = router.get(key)
        if given is not None and given != value:
            raise RouterConfigError(f"router.{key}", f"router.{key}={given!r} and its alias model.{alias}={value!r} "
                                                     "disagree: give one of them")
        router[key] = value
    return tree


def model_router(args: ModelArgs, router: Optional[RouterConfig] = None) -> RouterConfig:
    """The router of the model recipe ``args``: ``router`` (a run's router group), or, without one, the one its aliases
    give (a recipe built alone; no alias: no router); checked against the model (``check_router``)."""
    aliases = {key: getattr(args, alias) for key, alias in ALIASES.items() if getattr(args, alias) is not None}
    if router is None:
        router = RouterConfig(**aliases)
        check_router(router, args, args.num_layers, {key: f"model.{alias}" for key, alias in ALIASES.items()})
        return router
    if aliases:
        key = next(iter(aliases))
        raise RouterConfigError(f"model.{ALIASES[key]}", f"model.{ALIASES[key]}={aliases[key]!r} beside a run's "
                                                         f"router group: give router.{key} instead")
    check_router(router, args, args.num_layers)
    return router


def check_router(router: RouterConfig, mixer: MixerConfig, num_layers: int, names: Dict[str, str] = KEYS) -> None:
    """The router's architecture against the model's mixers and its ``num_layers``: positive sizes, two mixers to
    choose between, no more layers than the model has. RouterConfigError names the key by ``names``."""
    for key in ALIASES:
        value = getattr(router, key)
        if key == "hidden" and value is None:  # no router
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RouterConfigError(names[key], f"{names[key]}={value!r} must be a positive integer")
    if router.hidden is not None and not mixer.is_multi_mixer:
        raise RouterConfigError(names["hidden"], f"{names['hidden']}={router.hidden}: a router chooses between two "
                                                 f"mixers, got mixers={mixer.mixers!r}")
    if router.layers > num_layers:
        raise RouterConfigError(names["layers"], f"{names['layers']}={router.layers} exceeds the model's "
                                                 f"num_layers={num_layers}")
    routed = None if mixer.layer_pattern is None else pattern_letters(mixer.layer_pattern)[: router.layers]
    if router.hidden is not None and routed is not None and set(routed) != {ORYX_BLOCK}:
        raise RouterConfigError(names["layers"], f"{names['layers']}={router.layers}: the router reads the model's "
                                                 f"first layers, which must be Oryx blocks ({ORYX_BLOCK!r}); "
                                                 f"layer_pattern={mixer.layer_pattern!r} begins {routed!r}")
