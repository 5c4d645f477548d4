"""The schema of recipes/experiment/<name>.yaml, and its loading and checks."""

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from oryx_megatron import RECIPES_DIR
from oryx_megatron.eval import mode_switch
from oryx_megatron.eval.ppl import evaluate_ppl
from oryx_megatron.eval.retrieval import evaluate_retrieval
from oryx_megatron.eval.routing import evaluate_routing

EXPERIMENTS_DIR = RECIPES_DIR / "experiment"
EVALS = {  # task -> the function its `eval` arguments go to (after model, run[, out])
    "ppl": evaluate_ppl,
    "mode_switch": mode_switch.evaluate_mode_switch,
    "mqar": evaluate_retrieval,
    "niah": evaluate_retrieval,
    "routing": evaluate_routing,  # a router per tested run (the experiment's `router` section)
}
SMOKE_KEYS = ("train", "eval", "seeds", "lrs", "validation", "router", "joint")  # what a smoke section may change


@dataclass
class Validation:
    """The validation split of a learning-rate sweep (eval/validation.py)."""

    seed: int = 1000  # must differ from every training seed and from the test's eval.seed
    num_samples: int = 256
    batch_size: int = 32


@dataclass
class Experiment:
    """Schema of recipes/experiment/<name>.yaml."""

    name: str
    claim: str  # the paper's claim under test, one line
    models: List[str]  # recipes/model/<name>
    seeds: List[int]
    eval: Dict[str, Any]  # task: one of EVALS; the rest: arguments of its function
    metrics: List[str]  # result columns tabulated (mean and std over seeds); the first is plotted
    groups: Dict[str, str] = field(default_factory=dict)  # oryx-train config-group choices, e.g. data: mqar
    train: Dict[str, Any] = field(default_factory=dict)  # oryx-train config (nested), shared by every run
    variants: Optional[Dict[str, Any]] = None  # name -> more oryx-train config; None: one variant, "base"
    match_params: Optional[str] = None  # a model of `models`: the others' ffn_hidden_size matched to its count
    lrs: List[float] = field(default_factory=list)  # optimizer.lr grid swept per (variant, model); []: no sweep
    model_lrs: Dict[str, float] = field(default_factory=dict)  # model -> its optimizer.lr, not swept (an earlier
    # experiment's choice for its family)
    sweep_seeds: Optional[List[int]] = None  # seeds of the sweep runs; None: the first of `seeds`
    validation: Validation = field(default_factory=Validation)
    # oryx-train config (nested) of a post-hoc router fitted to every tested run (router=posthoc,
    # init_from: that run's checkpoint); the evaluation then reads the model with its router
    router: Optional[Dict[str, Any]] = None
    # oryx-train config of a joint router trained on from every tested run (router=joint, init_from: that run's
    # checkpoint: the model trains on with the router choosing its modes); evaluated as the post-hoc one (its
    # budgets at p >= 0.5 under their quota: a joint router has no calibration), its rows prefixed "joint:"
    joint: Optional[Dict[str, Any]] = None
    smoke: Dict[str, Any] = field(default_factory=dict)  # SMOKE_KEYS: merged in (train, eval) or replaced by --smoke


def load_experiment(name: str, smoke: bool = False, seeds: Optional[List[int]] = None) -> Experiment:
    """The experiment's config (Hydra-composed: an experiment may extend another through its
    defaults list), checked against the schema; ``smoke`` merges its smoke section."""
    if not (EXPERIMENTS_DIR / f"{name}.yaml").exists():
        known = ", ".join(sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")))
        raise ValueError(f"unknown experiment {name!r}; recipes/experiment/ has {known}")
    with initialize_config_dir(str(EXPERIMENTS_DIR), version_base=None):
        cfg = compose(name)
    try:
        exp: Experiment = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Experiment), cfg))
    except OmegaConfBaseException as e:
        raise ValueError(f"recipes/experiment/{name}.yaml: {e.msg}") from None
    exp.variants = exp.variants or {"base": {}}
    if smoke:
        apply_smoke(exp, name)
    if seeds:
        exp.seeds = seeds
    exp.sweep_seeds = exp.sweep_seeds or exp.seeds[:1]
    task = exp.eval.get("task")
    if task not in EVALS:
        raise ValueError(f"recipes/experiment/{name}.yaml: eval.task={task!r}; expected one of {sorted(EVALS)}")
    allowed = set(inspect.signature(EVALS[task]).parameters) - {"model", "run", "out", "task"}  # set by evaluate
    unknown = set(eval_arguments(exp)) - allowed
    if unknown:
        raise ValueError(f"recipes/experiment/{name}.yaml: eval.{sorted(unknown)[0]} is not an argument of {task}")
    check_fairness(exp, name)
    return exp


def apply_smoke(exp: Experiment, name: str) -> None:
    """Merge the smoke section: train and eval extend, seeds, lrs and validation replace."""
    unknown = set(exp.smoke) - set(SMOKE_KEYS)
    if unknown:
        raise ValueError(f"recipes/experiment/{name}.yaml: smoke.{sorted(unknown)[0]} is not one of {SMOKE_KEYS}")
    exp.train = OmegaConf.to_container(OmegaConf.merge(exp.train, exp.smoke.get("train", {})))
    exp.eval = {**exp.eval, **exp.smoke.get("eval", {})}
    exp.seeds = list(exp.smoke.get("seeds", exp.seeds))
    exp.lrs = list(exp.smoke.get("lrs", exp.lrs))
    exp.validation = dataclasses.replace(exp.validation, **exp.smoke.get("validation", {}))
    for section in ("router", "joint"):
        if getattr(exp, section) is not None:
            merged = OmegaConf.merge(getattr(exp, section), exp.smoke.get(section, {}))
            setattr(exp, section, OmegaConf.to_container(merged))


def check_fairness(exp: Experiment, name: str) -> None:
    """match_params is one of the models; a sweep has MQAR data and a validation seed that is
    neither a training seed nor the test's (eval.seed)."""
    where = f"recipes/experiment/{name}.yaml"
    if exp.match_params is not None and exp.match_params not in exp.models:
        raise ValueError(f"{where}: match_params={exp.match_params!r} is not one of models {exp.models}")
    for model in exp.model_lrs:
        if model not in exp.models:
            raise ValueError(f"{where}: model_lrs.{model} is not one of models {exp.models}")
        if exp.lrs:
            raise ValueError(f"{where}: model_lrs.{model} beside lrs: a model is swept or given its rate, not both")
    if not exp.lrs:
        return
    if exp.groups.get("data") != "mqar":
        raise ValueError(f"{where}: lrs needs groups.data=mqar (the validation split is generated MQAR), "
                         f"got {exp.groups.get('data')!r}")
    test_seed = exp.eval.get("seed", 0)
    if exp.validation.seed in {*exp.seeds, *exp.sweep_seeds, test_seed}:
        raise ValueError(f"{where}: validation.seed={exp.validation.seed} must differ from the training seeds "
                         f"{sorted({*exp.seeds, *exp.sweep_seeds})} and the test's eval.seed={test_seed}")


def eval_arguments(exp: Experiment) -> Dict[str, Any]:
    return {k: v for k, v in exp.eval.items() if k != "task"}
