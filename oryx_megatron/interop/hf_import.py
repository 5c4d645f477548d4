"""``oryx-import hf``: a transformers folder (an ``oryx`` or an exported ``llama`` model) back to a megatron
distributed checkpoint that ``oryx-train`` resumes from and ``oryx-eval`` / ``oryx-generate`` read.

The checkpoint is iteration 0 of the run the folder's metadata describes (``oryx.run``, with ``overrides``
applied), at tensor-parallel size ``tp``: the weights are the folder's, bit for bit; the optimizer state is
fresh (zero moments), the LR schedule and the data order start from the beginning. Two steps: the weights
become a model-only checkpoint at TP = 1 in this process, which ``tp`` processes (gloo, on the CPU) load at
their layout, resharding as any resume does, and save with a fresh optimizer, schedule and loader.
"""

import json
import os
import shutil
import socket
from dataclasses import asdict
from pathlib import Path
from typing import Dict, Sequence

import torch
import torch.multiprocessing as mp
from megatron.core import dist_checkpointing
from omegaconf import OmegaConf
from safetensors.torch import load_file
from transformers import LlamaConfig

from oryx_megatron.checkpoint import LATEST, load_sharded
from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import ModelArgs
from oryx_megatron.hf.configuration import MODEL_TYPE, OryxHFConfig
from oryx_megatron.interop.hf_convert import LLAMA, ConversionError, hf_to_megatron, model_args, router_args
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.parallel import current_device, destroy_parallel, initialize_parallel
from oryx_megatron.run_config import TrainConfig, load_train_config
from oryx_megatron.training.builders import (
    build_loader,
    build_model_chunks,
    build_optimizer,
    build_scheduler,
    model_config,
)
from oryx_megatron.training.saving import save_checkpoint
from oryx_megatron.training.validation import validate_run

CONFIG_FILE = "config.json"
WEIGHTS_DIR = ".import_weights"  # the model-only TP = 1 checkpoint, inside the target dir while importing
CONFIG_CLASSES = {MODEL_TYPE: OryxHFConfig, LLAMA: LlamaConfig}


def read_folder(hf_dir: Path):
    """(config, weights) of a transformers folder; ConversionError naming the file on anything unreadable."""
    hf_dir = Path(hf_dir)
    try:
        model_type = json.loads((hf_dir / CONFIG_FILE).read_text()).get("model_type")
    except FileNotFoundError:
        raise ConversionError(f"{hf_dir}: no {CONFIG_FILE} (not a transformers model folder)") from None
    except (OSError, ValueError) as e:
        raise ConversionError(f"{hf_dir / CONFIG_FILE}: unreadable ({e})") from None
    if model_type not in CONFIG_CLASSES:
        raise ConversionError(f"{hf_dir / CONFIG_FILE}: model_type {model_type!r} is not an Oryx model ('oryx') "
                              f"or an exported Transformer ('llama')")
    config = CONFIG_CLASSES[model_type].from_pretrained(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    files = ["model.safetensors"]
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    weights = {}
    for name in files:
        if not (hf_dir / name).is_file():
            raise ConversionError(f"{hf_dir / name}: missing (the folder's weights)")
        weights.update(load_file(str(hf_dir / name)))
    rows = weights.get("model.embed_tokens.weight", torch.empty(0)).shape[0]
    if rows != config.vocab_size:
        raise ConversionError(f"{hf_dir}: model.embed_tokens.weight has {rows} rows but {CONFIG_FILE} says "
                              f"vocab_size={config.vocab_size}")
    _check_tokenizer(hf_dir, config)
    return config, weights


def _check_tokenizer(hf_dir: Path, config) -> None:
    """The folder's tokenizer (when it has one) must fit the embedding."""
    path = hf_dir / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        if size > config.vocab_size:
            raise ConversionError(f"{path}: the tokenizer's vocab ({size}) is larger than the model's "
                                  f"vocab_size={config.vocab_size}")


def import_run(config, args: ModelArgs, checkpoint_dir: Path, tp: int, overrides: Sequence[str] = ()) -> TrainConfig:
    """The run of the checkpoint: the folder's ``oryx.run`` (or the schema's defaults), its model ``args`` and router,
    ``tp``, ``checkpoint.dir``, then ``overrides`` (``KEY=VALUE``, as oryx-train's); validated as oryx-train
    validates (ConfigError naming the key)."""
    stored = dict(getattr(config, "oryx", {}).get("run", {}))
    tree = OmegaConf.merge(
        OmegaConf.create(stored),
        {"model": asdict(args), "router": router_args(config),
         "parallel": {"tensor_model_parallel_size": tp, "context_parallel_size": 1},
         "checkpoint": {"dir": str(checkpoint_dir)}},
        OmegaConf.from_dotlist(list(overrides)),
    )
    run = load_train_config(tree)
    validate_run(run, world_size=tp)
    return run


def import_checkpoint(hf_dir: Path, checkpoint_dir: Path, tp: int = 1, overrides: Sequence[str] = ()) -> Path:
    """Write ``checkpoint_dir/iter_0000000`` (and ``latest``) from the folder ``hf_dir``; returns it."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / LATEST).exists():
        raise ConversionError(f"{checkpoint_dir}: holds checkpoints already ({LATEST}); import into a new directory")
    config, weights = read_folder(hf_dir)
    try:
        args = model_args(config)
    except ConversionError as e:
        raise ConversionError(f"{Path(hf_dir) / CONFIG_FILE}: {e}") from None
    run = import_run(config, args, checkpoint_dir, tp, overrides)
    state = hf_to_megatron(weights, config)
    created = not checkpoint_dir.exists()
    weights_dir = checkpoint_dir / WEIGHTS_DIR
    try:
        write_model_checkpoint(run, state, weights_dir)
        if tp == 1:
            write_training_checkpoint(run, weights_dir)
        else:
            _spawn(tp, run, weights_dir)
    except BaseException:
        shutil.rmtree(checkpoint_dir if created else weights_dir, ignore_errors=True)
        raise
    shutil.rmtree(weights_dir, ignore_errors=True)
    return checkpoint_dir / "iter_0000000"


def write_model_checkpoint(run: TrainConfig, state: Dict[str, torch.Tensor], path: Path) -> None:
    """``state`` (megatron names, full tensors) as a model-only distributed checkpoint at TP = PP = 1,
    in the run's parameter dtype (the SSM scalars in fp32)."""
    initialize_parallel(seed=run.train.seed)
    dtype = torch.bfloat16 if run.train.bf16 else torch.float32
    model = build_model(run.model, transformer_config(run.model, run.router, params_dtype=dtype,
                                                      perform_initialization=False))
    target = model.state_dict()
    wanted = {k for k in target if not k.endswith("_extra_state")}
    if set(state) != wanted:
        extra, missing = sorted(set(state) - wanted), sorted(wanted - set(state))
        raise ConversionError(f"the weights do not fit the {run.model.family} model: "
                              + (f"no megatron parameter for {extra[0]!r}" if extra else f"{missing[0]!r} is missing"))
    for name, tensor in state.items():
        if tensor.shape != target[name].shape:
            raise ConversionError(f"{name}: shape {tuple(tensor.shape)}, the model's is {tuple(target[name].shape)}")
        target[name] = tensor.to(target[name].dtype)
    model.load_state_dict(target)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(path))


def write_training_checkpoint(run: TrainConfig, weights: Path) -> Path:
    """On every rank of the run's layout: the model loaded from the model-only checkpoint ``weights``, a fresh
    optimizer, LR schedule and loader, saved as iteration 0 of ``run.checkpoint.dir``."""
    p = run.parallel
    initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, run.train.seed,
                        p.virtual_pipeline_model_parallel_size, p.distributed_timeout_minutes)
    with cuda_to_cpu():
        model = build_model_chunks(run, model_config(run), current_device())
        for chunk in model:
            chunk.module.load_state_dict(load_sharded({"model": chunk.module.sharded_state_dict()}, weights)["model"])
        optimizer = build_optimizer(run, model)
        start_fresh(optimizer)
        scheduler = build_scheduler(run, optimizer)
        run_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))
        with build_loader(run) as loader:
            return save_checkpoint(run.checkpoint.dir, 0, model, optimizer, scheduler, loader, run_yaml)


def start_fresh(optimizer) -> None:
    """Give a never-stepped optimizer the state of step 0 (zero moments, a step of 0 per parameter), which
    megatron needs to save it (``checkpointing.load_checkpoint`` gives a step of 0 back: megatron drops it)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if opt.init_state_fn is None:  # SGD: no state before its first step, none needed after a load
            continue
        opt.init_state_fn(opt.optimizer, opt.config)
        for state in opt.optimizer.state.values():
            state.setdefault("step", torch.tensor(0.0))


def _spawn(world_size: int, run: TrainConfig, weights: Path) -> None:
    """``write_training_checkpoint`` in ``world_size`` gloo processes on the CPU."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the processes inherit it: a CPU job whatever GPUs there are
    try:
        mp.spawn(_worker, args=(world_size, port, run, weights), nprocs=world_size, join=True)
    finally:
        if visible is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible


def _worker(rank: int, world_size: int, port: int, run: TrainConfig, weights: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        write_training_checkpoint(run, weights)
    finally:
        destroy_parallel()
