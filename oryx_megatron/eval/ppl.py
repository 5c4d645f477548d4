"""Held-out perplexity under mode schedules, and the held-out-data helpers the other evals share.

The windows come from the checkpoint's dataset through the loader of training eval (valid
split); every schedule reads the same windows, so the losses differ only by modes, and the
modes are the loader's (keyed by global sample index and seed), so ``random_chunks``
reproduces the training eval's draws.
"""

import dataclasses
import math
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import Mode
from oryx_megatron.data.loader import parse_blend
from oryx_megatron.data.modes import (
    ModeSchedule,
    RandomChunks,
    all_attention,
    all_linear,
    build_mode_schedule,
    linear_then_attention,
)
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.data.shards import Manifest
from oryx_megatron.inference.routing import route_modes
from oryx_megatron.models import flops
from oryx_megatron.parallel import context_parallel, this_rank_tokens, whole_sequences
from oryx_megatron.run_config import TrainConfig
from oryx_megatron.training.builders import build_loader


def dataset_vocab(run: TrainConfig) -> Tuple[int, Optional[int]]:
    """(tokenizer vocab size, EOD id) of the checkpoint's dataset: its manifest for shards;
    model.vocab_size and data.eod_id for indexed data (no manifest); the id range and no EOD
    (None) for synthetic MQAR."""
    if run.data.format == "mqar":
        return run.data.mqar_vocab_size or run.model.vocab_size, None
    if run.data.format == "indexed":
        return run.model.vocab_size, run.data.eod_id
    manifest = Manifest.read(parse_blend(run.data.data_path)[0][0])
    return manifest.vocab_size, manifest.eod_id


def document_reset_id(run: TrainConfig) -> Optional[int]:
    """The EOD id at which generation restarts every state, for a run trained with data.reset_at_eod
    (``generate(..., reset_at_eod=...)``); None for one trained across documents."""
    return dataset_vocab(run)[1] if run.data.reset_at_eod else None


def schedule_batches(model, run: TrainConfig, num_batches: int, batch_size: int,
                     schedule: Union[ModeSchedule, RouterSchedule]) -> List[Dict[str, Tensor]]:
    """``heldout_batches`` under a data-layer schedule, or under a router schedule (the modes of one
    routing pass over each batch, ``route_modes``)."""
    if not isinstance(schedule, RouterSchedule):
        return heldout_batches(run, num_batches, batch_size, schedule)
    batches = heldout_batches(run, num_batches, batch_size, all_linear())
    device = next(model.parameters()).device
    with torch.no_grad():
        for b in batches:
            docs = b.get("document_ids")
            b["modes"] = route_modes(model, schedule, b["tokens"].to(device),
                                     None if docs is None else docs.to(device)).cpu()
    return batches


def heldout_batches(run: TrainConfig, num_batches: int, batch_size: int,
                    schedule: Optional[ModeSchedule] = None) -> List[Dict[str, Tensor]]:
    """The first ``num_batches`` batches of the held-out loader (the valid split of training eval):
    tokens, labels, modes and loss_mask (and document_ids with data.reset_at_eod) [batch_size,
    seq_length], the modes drawn by ``schedule`` (default:
    the run's) as the loader keys them, by global sample index and seed."""
    run = dataclasses.replace(
        run,
        data=dataclasses.replace(run.data, num_workers=0),
        train=dataclasses.replace(run.train, micro_batch_size=batch_size, global_batch_size=batch_size,
                                  eval_iters=num_batches),
    )
    keys = ("tokens", "labels", "modes", "loss_mask") + (("document_ids",) if run.data.reset_at_eod else ())
    with build_loader(run, split="valid", mode_schedule=schedule) as loader:
        return [{key: batch[key] for key in keys} for batch, _ in zip(loader, range(num_batches))]


@torch.no_grad()
def token_losses(model, batches: List[Dict[str, Tensor]]) -> Tensor:
    """Per-token loss [n, s] fp32 of every window, each token reading with its batch's mode (and, for a
    run trained with data.reset_at_eod, within its document); under context parallelism every sequence split
    over the ranks, the losses gathered."""
    device = next(model.parameters()).device
    losses = []
    for b in batches:
        docs = b.get("document_ids")
        local = this_rank_tokens(tokens=b["tokens"].to(device), labels=b["labels"].to(device))  # context parallel
        with cuda_to_cpu(context_parallel()):  # megatron's context-parallel rotary asks for pinned memory
            loss = model(local["tokens"], b["modes"].to(device), labels=local["labels"],
                         document_ids=None if docs is None else docs.to(device))
        losses.append(whole_sequences(loss.float()).cpu())
    return torch.cat(losses)


def ppl_schedules(run: TrainConfig, attention_last: int) -> Dict[str, ModeSchedule]:
    """The schedules of the ppl task; ``random_chunks`` is the training one (its defaults if the
    run trained with another schedule)."""
    train = build_mode_schedule(run.data.mode_schedule)
    return {
        "all_attention": all_attention(),
        "all_linear": all_linear(),
        "random_chunks": train if isinstance(train, RandomChunks) else RandomChunks(),
        "linear_then_attention": linear_then_attention(attention_last),
    }


def attention_reads(model, attention_fraction: float) -> float:
    """Of every layer's reads of the tokens, the share in attention when ``attention_fraction`` of the tokens' modes
    read it (``models.flops.attention_layers``): the modes' fraction in a model of Oryx blocks, 1 for the
    Transformer, 0 for Mamba-2 and GDN, and per layer in a layer pattern (``MMM*``: 0.25 whatever the modes):
    what matches the attention compute of the two axes of hybridization (E4)."""
    config = model.config
    return flops.attention_layers(config, attention_fraction) / config.num_layers


def _mean(values: Tensor) -> Optional[float]:
    return float(values.mean()) if values.numel() else None


def evaluate_ppl(model, run: TrainConfig, num_batches: int = 8, batch_size: int = 4,
                 attention_last: Optional[int] = None, router: Optional[RouterSchedule] = None) -> dict:
    """Held-out loss and perplexity under each of ``ppl_schedules`` (and ``router``, a router
    schedule); ``attention_last`` (default seq_length // 8) is the attention tail of
    linear_then_attention. One row per schedule: loss, perplexity = exp(loss), attention_fraction (of the tokens'
    modes), attention_reads, loss over attention / linear tokens (None when there are none)."""
    seq_len = run.data.seq_length
    attention_last = max(seq_len // 8, 1) if attention_last is None else attention_last
    rows = []
    schedules = {**ppl_schedules(run, attention_last), **({str(router): router} if router else {})}
    for name, schedule in schedules.items():
        batches = schedule_batches(model, run, num_batches, batch_size, schedule)  # the same windows each time
        loss = token_losses(model, batches)
        attention = torch.cat([b["modes"] for b in batches]) == Mode.ATTENTION
        mean = float(loss.mean())
        fraction = float(attention.float().mean())
        rows.append(dict(schedule=name, loss=mean, perplexity=math.exp(mean), attention_fraction=fraction,
                         attention_reads=attention_reads(model, fraction),
                         loss_attention=_mean(loss[attention]), loss_linear=_mean(loss[~attention])))
    return dict(task="ppl", tokens=num_batches * batch_size * seq_len, seq_length=seq_len,
                attention_last=attention_last, rows=rows)
