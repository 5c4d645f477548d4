"""The structured schema of ``oryx-train``'s config (recipes/train.yaml and its groups).

Hydra composes the YAML onto this schema (``train_schema``), and ``load_train_config``
checks the values, so a misspelled key, a wrong type or a bad value fails before any
process group starts, naming the key.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from oryx_megatron.config import MixerConfigError, ModelArgs, RouterConfig, RouterConfigError
from oryx_megatron.config.pattern import LayerPatternError, pipeline_segments
from oryx_megatron.config.router import UNSET, check_router, move_aliases
from oryx_megatron.data.tasks.mqar import MQARConfig
from oryx_megatron.mixer import linear_mixer_class


@dataclass
class DataConfig:
    format: str = "shards"  # "shards" (oryx-prep manifests), "indexed" (Megatron .bin/.idx) or "mqar" (synthetic)
    data_path: List[str] = field(default_factory=list)  # paths, or Megatron's [w1, p1, w2, p2, ...]
    seq_length: int = 512
    num_workers: int = 0
    holdout_shards: int = 1  # shards: the last N shards of each source are the held-out split
    eod_id: Optional[int] = None  # indexed: the tokenizer's end-of-document id
    split: str = "98,2,0"  # indexed: Megatron's --split of documents into train, valid, test
    reset_at_eod: bool = False  # batches hold document_ids (the document of each token; docs/data.md)
    mode_schedule: Dict[str, Any] = field(
        default_factory=lambda: {"name": "random_chunks", "chunk_size": 128, "p_attention": 0.5}
    )
    mqar_num_pairs: int = 8  # mqar: key-value pairs per sample
    mqar_num_queries: Optional[int] = None  # mqar: queries (answers) per sample; None: mqar_num_pairs
    mqar_vocab_size: Optional[int] = None  # mqar: ids drawn from [0, this); None: model.vocab_size
    mqar_filler_id: Optional[int] = None  # mqar: the token between context and queries (not a key id); None: noise
    mqar_query_spans: Optional[int] = None  # mqar: None: the queries last; S: scattered in S spans (data/tasks/mqar.py)
    mqar_context_segments: Optional[int] = None  # mqar, scattered: segments of the pairs (None: mqar_query_spans)


@dataclass
class OptimizerConfig:
    optimizer: str = "adam"  # "adam" (AdamW) or "sgd"
    lr: float = 3e-3
    min_lr: float = 3e-4
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    lr_warmup_iters: int = 100
    lr_decay_style: str = "cosine"  # "cosine", "linear", "constant" or "WSD"
    lr_wsd_decay_iters: Optional[int] = None  # WSD: length of the final decay
    lr_wsd_decay_style: str = "linear"


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1  # ranks that split every sequence (head all-to-all; docs/training.md)
    overlap_grad_reduce: bool = False
    distributed_timeout_minutes: float = 10.0  # a collective waiting longer (a dead or hung rank) fails the run


@dataclass
class TrainingConfig:
    seed: int = 1234
    micro_batch_size: int = 4
    global_batch_size: int = 16
    train_iters: Optional[int] = None
    train_tokens: Optional[int] = None  # the token budget; sets train_iters when train_iters is unset
    exit_interval: Optional[int] = None  # stop (saving a checkpoint) after this many iterations of this job
    log_interval: int = 10
    eval_interval: Optional[int] = None
    eval_iters: int = 10
    eval_schedules: List[str] = field(default_factory=lambda: ["all_attention", "all_linear"])
    bf16: bool = False
    recompute_granularity: Optional[str] = None  # activation recomputation: "selective" (the mixers) | "full" (layers)
    max_skipped_steps: int = 5  # this many non-finite (skipped) optimizer steps in a row stop the run
    loss_spike_window: int = 50  # loss spikes: a loss above mean + threshold x std of this many previous steps
    loss_spike_threshold: float = 4.0  # ... is logged as a spike (train/loss_spikes); <= 0 disables the detector


@dataclass
class CheckpointConfig:
    dir: Optional[str] = None  # resumes from <dir>/latest when present
    save_interval: Optional[int] = None
    save_at_end: bool = True
    load: bool = True
    keep_last: Optional[int] = None  # after each save, delete all but the N newest (None: keep all)
    keep_every: Optional[int] = None  # with keep_last: also keep every iteration divisible by this
    async_save: bool = False  # write the shards in the background; `latest` moves once every rank is done


@dataclass
class LoggingConfig:
    wandb_mode: str = "offline"  # "online", "offline" or "disabled"
    wandb_project: str = "oryx-megatron"
    wandb_entity: Optional[str] = None
    run_name: Optional[str] = None
    peak_tflops: float = 989.0  # per device, for MFU (H100/H200 dense bf16)
    output_dir: Optional[str] = None  # defaults to Hydra's run directory


@dataclass
class TrainConfig:
    model: ModelArgs
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    router: RouterConfig = field(default_factory=RouterConfig)  # the chunk router and its training (config/router.py)


# recipes/train.yaml lists this schema first in its defaults: every composed key is typed. The router's architecture
# keys with a default are left unset there (null), so that an alias given beside one is told apart from its default.
TRAIN_SCHEMA = OmegaConf.merge(OmegaConf.structured(TrainConfig), {"router": dict.fromkeys(UNSET)})
ConfigStore.instance().store(name="train_schema", node=TRAIN_SCHEMA)

CHOICES = {
    "data.format": ("shards", "indexed", "mqar"),
    "optimizer.optimizer": ("adam", "sgd"),
    "optimizer.lr_decay_style": ("cosine", "linear", "constant", "WSD"),
    "logging.wandb_mode": ("online", "offline", "disabled"),
    "router.mode": ("none", "posthoc", "joint"),
    "router.objective": ("classification", "regression"),
}


class ConfigError(ValueError):
    """A bad config key or value; the message names it."""


def load_train_config(cfg: DictConfig) -> TrainConfig:
    """Validate a composed config against the schema (keys, types, values); the router's aliases
    (``model.router_hidden``, ...) are read as their keys (``router.hidden``, ...)."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        # merged as a plain container: keys that Hydra let in with "+key=" are rejected here
        tree = move_aliases(OmegaConf.to_container(cfg))
        run: TrainConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), tree))
        linear_mixer_class(run.model)  # a registered linear mixer
        check_router(run.router, run.model, run.model.num_layers)
        if run.model.layer_pattern is not None:  # its pipeline segments against the run's stages
            pipeline_segments(run.model.layer_pattern, run.parallel.pipeline_model_parallel_size
                              * (run.parallel.virtual_pipeline_model_parallel_size or 1))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"config key {key!r}: {e.msg if hasattr(e, 'msg') else e}") from None
    except MixerConfigError as e:
        raise ConfigError(f"config key 'model.{e.field}': {e}") from None
    except LayerPatternError as e:
        raise ConfigError(f"config key 'model.layer_pattern': {e}") from None
    except RouterConfigError as e:
        raise ConfigError(f"config key '{e.key}': {e}") from None
    _check_values(run)
    return run


def _check_values(run: TrainConfig) -> None:
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(run, section), name)
        if value not in allowed:
            raise ConfigError(f"config key '{key}': {value!r} is not one of {allowed}")
    t, p = run.train, run.parallel
    _check_router(run)
    positive = {
        "train.micro_batch_size": t.micro_batch_size,
        "train.global_batch_size": t.global_batch_size,
        "train.log_interval": t.log_interval,
        "data.seq_length": run.data.seq_length,
        "parallel.tensor_model_parallel_size": p.tensor_model_parallel_size,
        "parallel.pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "parallel.context_parallel_size": p.context_parallel_size,
        "optimizer.lr": run.optimizer.lr,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key '{key}': {value} must be positive")
    _check_context_parallel(run)
    vp = p.virtual_pipeline_model_parallel_size  # interleaved pipeline: vp model chunks per pipeline stage
    if vp is not None:
        key = "config key 'parallel.virtual_pipeline_model_parallel_size'"
        if vp < 2 or p.pipeline_model_parallel_size < 2:
            raise ConfigError(f"{key}: {vp} needs a value of at least 2 and parallel.pipeline_model_parallel_size "
                              f"of at least 2 (it is {p.pipeline_model_parallel_size}); null: no interleaving")
        if run.model.num_layers % (p.pipeline_model_parallel_size * vp):
            raise ConfigError(f"{key}: model.num_layers={run.model.num_layers} is not a multiple of pipeline x "
                              f"virtual pipeline size {p.pipeline_model_parallel_size} x {vp}")
    if (t.train_iters is None) == (t.train_tokens is None):
        raise ConfigError("config keys 'train.train_iters' / 'train.train_tokens': set exactly one")
    if t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"config key 'train.global_batch_size': {t.global_batch_size} is not a multiple of "
            f"train.micro_batch_size={t.micro_batch_size}"
        )
    if run.data.format != "mqar" and not run.data.data_path:
        raise ConfigError("config key 'data.data_path': no dataset given")
    if run.data.format == "indexed" and run.data.eod_id is None:
        raise ConfigError("config key 'data.eod_id': required with data.format=indexed")
    if run.data.format == "mqar" and run.data.mqar_vocab_size is not None and not (
            2 <= run.data.mqar_vocab_size <= run.model.vocab_size):
        raise ConfigError(
            f"config key 'data.mqar_vocab_size': {run.data.mqar_vocab_size} must be in "
            f"[2, model.vocab_size={run.model.vocab_size}]"
        )
    if run.data.format == "mqar":
        try:
            mqar_task(run)
        except ValueError as e:
            raise ConfigError(f"config keys 'data.mqar_*' / 'data.seq_length': {e}") from None
    if run.data.seq_length > run.model.max_sequence_length:
        raise ConfigError(
            f"config key 'data.seq_length': {run.data.seq_length} exceeds "
            f"model.max_sequence_length={run.model.max_sequence_length}"
        )


def train_iters(run: TrainConfig) -> int:
    """train.train_iters, or the token budget in iterations."""
    t = run.train
    if t.train_iters is not None:
        return t.train_iters
    return max(1, t.train_tokens // (t.global_batch_size * run.data.seq_length))


def mqar_task(run: TrainConfig, seed: int = 0) -> MQARConfig:
    """The MQARConfig of a ``data.format=mqar`` run: ids from [0, data.mqar_vocab_size or
    model.vocab_size); raises ValueError on sizes that do not fit."""
    d = run.data
    return MQARConfig(d.mqar_vocab_size or run.model.vocab_size, d.seq_length, d.mqar_num_pairs, d.mqar_num_queries,
                      seed=seed, filler_id=d.mqar_filler_id, query_spans=d.mqar_query_spans,
                      context_segments=d.mqar_context_segments)


def _check_router(run: TrainConfig) -> None:
    """router=posthoc needs a multi-mixer model with a router, the model to start from, one process."""
    r = run.router
    if r.mode == "none":
        return
    if r.hidden is None:
        raise ConfigError(f"config key 'router.hidden': router.mode={r.mode} needs a router width (e.g. 64)")
    if r.mode == "joint":
        if run.parallel.pipeline_model_parallel_size != 1:
            raise ConfigError("config key 'router.mode': joint routing needs pipeline_model_parallel_size=1 (the "
                              "router reads the first layer and its modes reach every layer)")
        if not 0 < r.budget < 1 or r.price_lr < 0:
            raise ConfigError(f"config keys 'router.budget' / 'router.price_lr': {r.budget} must be in (0, 1), "
                              f"{r.price_lr} >= 0")
        if r.estimator not in ("straight_through", "score_function"):
            raise ConfigError(f"config key 'router.estimator': {r.estimator!r}; expected 'straight_through' or "
                              "'score_function'")
        return
    if not r.init_from:
        raise ConfigError("config key 'router.init_from': router.mode=posthoc fits the router of a trained model: "
                          "give its checkpoint (or the run's checkpoint.dir)")
    p = run.parallel
    if (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) != (1, 1):
        raise ConfigError("config key 'router.mode': posthoc router training runs at tensor and pipeline parallel "
                          f"size 1 (the router is small), got {p.tensor_model_parallel_size} and "
                          f"{p.pipeline_model_parallel_size}")
    if r.temperature <= 0 or r.calibration_batches < 1:
        raise ConfigError(f"config keys 'router.temperature' / 'router.calibration_batches': {r.temperature}, "
                          f"{r.calibration_batches} must be positive")


def _check_context_parallel(run: TrainConfig) -> None:
    """Context parallelism splits every sequence into 2 x CP chunks and each layer's heads over TP x CP ranks."""
    p, cp = run.parallel, run.parallel.context_parallel_size
    if cp == 1:
        return
    key = "config key 'parallel.context_parallel_size'"
    if run.data.seq_length % (2 * cp):
        raise ConfigError(f"{key}: data.seq_length={run.data.seq_length} must divide by 2 x {cp} (megatron's "
                          "load-balanced split of every sequence into 2 x CP chunks)")
    if run.model.num_attention_heads % (p.tensor_model_parallel_size * cp):
        raise ConfigError(f"{key}: model.num_attention_heads={run.model.num_attention_heads} must divide by tensor "
                          f"x context parallel size {p.tensor_model_parallel_size} x {cp} (each rank mixes whole "
                          "heads of the whole sequence)")
    if run.router.mode == "posthoc":
        raise ConfigError(f"{key}: {cp}: posthoc router training runs in one process (the router is small)")
