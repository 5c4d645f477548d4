"""Retrieval accuracy (MQAR, needle in a haystack) under all_attention, all_linear and mixed mode.

Teacher-forced: one parallel forward per batch of samples; the prediction of an answer token
is the argmax of the logits (restricted to the tokenizer's vocab) at the position before it.
``accuracy``: samples whose answer tokens are all right; ``token_accuracy``: answer tokens
right. ``mixed`` is the task's ``mixed_mode_schedule`` (linear context, attention on the
question/answer span); ``attention_fraction`` is the share of input tokens whose mode reads attention,
``attention_reads`` the share of (layer, token) reads in attention (``ppl.attention_reads``).

Ids: keys and values come from the largest id range of the tokenizer that leaves out the EOD
id; NIAH uses the EOD id as its needle marker, so a held-out haystack (EOD removed between
documents) never contains it.
"""

from typing import Dict, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import Mode
from oryx_megatron.data.modes import ModeSchedule, all_attention, all_linear
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.data.tasks import mqar, niah
from oryx_megatron.eval.ppl import attention_reads, dataset_vocab, heldout_batches
from oryx_megatron.inference.routing import route_modes
from oryx_megatron.parallel import context_parallel, this_rank_tokens, whole_sequences
from oryx_megatron.run_config import TrainConfig

TASKS = ("mqar", "niah")


def id_range(vocab_size: int, reserved: int) -> Tuple[int, int]:
    """The larger of [0, reserved) and [reserved + 1, vocab_size)."""
    return (0, reserved) if reserved >= vocab_size - 1 - reserved else (reserved + 1, vocab_size)


@torch.no_grad()
def answer_accuracy(model, sample: Dict[str, np.ndarray], schedule: Union[ModeSchedule, RouterSchedule],
                    vocab_size: int, batch_size: int) -> dict:
    """Exact-match and per-token accuracy of the answers, and the attention fraction of the modes (a
    router schedule's: one routing pass over each sample)."""
    inputs, labels, mask = (torch.from_numpy(np.ascontiguousarray(sample[key]))
                            for key in ("inputs", "labels", "answer_mask"))  # [n, L]
    n, seq_len = inputs.shape
    device = next(model.parameters()).device
    if isinstance(schedule, RouterSchedule):
        modes = torch.cat([route_modes(model, schedule, inputs[i : i + batch_size].to(device)).cpu()
                           for i in range(0, n, batch_size)])
    else:
        modes = schedule.batch(seq_len, range(n))  # int8 [n, L]
    correct = torch.cat([predictions(model, inputs[i : i + batch_size].to(device), modes[i : i + batch_size].to(device),
                                     vocab_size).cpu() == labels[i : i + batch_size]
                         for i in range(0, n, batch_size)])  # bool [n, L]
    right = (correct | ~mask).all(1)  # [n]: every answer token right
    attention = float((modes == Mode.ATTENTION).float().mean())
    return dict(accuracy=float(right.float().mean()), token_accuracy=float(correct[mask].float().mean()),
                attention_fraction=attention, attention_reads=attention_reads(model, attention))


def predictions(model, inputs: Tensor, modes: Tensor, vocab_size: int) -> Tensor:
    """The greedy next token [b, L] at every position (under context parallelism every sequence split over the
    ranks, the predictions gathered)."""
    local = this_rank_tokens(tokens=inputs)["tokens"]
    with cuda_to_cpu(context_parallel()):  # megatron's context-parallel rotary asks for pinned memory
        return whole_sequences(model(local, modes)[..., :vocab_size].argmax(-1))


def heldout_haystack(run: TrainConfig, tokens: int, eod_id: int) -> np.ndarray:
    """At least ``tokens`` held-out tokens (EOD removed) as one stream [>= tokens]."""
    windows = -(-2 * tokens // run.data.seq_length)  # twice the need: EODs are removed
    stream = torch.cat([b["tokens"].flatten() for b in heldout_batches(run, windows, 1)]).numpy()
    return stream[stream != eod_id]


def mqar_layout(run: TrainConfig, query_spans: Optional[int], context_segments: Optional[int]):
    """(query spans, context segments) of MQAR's layout: ``query_spans`` None, the checkpoint's (an MQAR-trained
    one's data.mqar_query_spans, data.mqar_context_segments); 0, the queries last (None, None); S, scattered."""
    if query_spans is None and run.data.format == "mqar":
        return run.data.mqar_query_spans, context_segments or run.data.mqar_context_segments
    return (query_spans or None), (context_segments if query_spans else None)


def build_task(task: str, run: TrainConfig, num_samples: int, seq_len: int, seed: int, haystack: str,
               num_pairs: int, num_queries: Optional[int], num_needles: int, key_len: int, value_len: int,
               query_spans: Optional[int] = None, context_segments: Optional[int] = None):
    """(samples, mixed schedule, haystack source) of ``task`` for the checkpoint's vocab (an
    MQAR-trained checkpoint: its training distribution); MQAR's layout: ``mqar_layout``."""
    if task not in TASKS:
        raise ValueError(f"unknown retrieval task {task!r}; choose one of {', '.join(TASKS)}")
    vocab_size, eod_id = dataset_vocab(run)
    if eod_id is None and task == "niah":
        raise ValueError("niah needs a tokenized dataset (its EOD id marks the needle); this checkpoint "
                         f"trained on data.format={run.data.format}")
    ids = (0, vocab_size) if eod_id is None else id_range(vocab_size, eod_id)
    if task == "mqar":
        filler = run.data.mqar_filler_id if run.data.format == "mqar" else None  # the training filler
        query_spans, context_segments = mqar_layout(run, query_spans, context_segments)
        cfg = mqar.MQARConfig(vocab_size, seq_len, num_pairs, num_queries, seed=seed, id_range=ids, filler_id=filler,
                              query_spans=query_spans, context_segments=context_segments)
        sample = mqar.generate_mqar(cfg, num_samples)
        return sample, mqar.mixed_mode_schedule(cfg, sample), None
    cfg = niah.NIAHConfig(vocab_size, seq_len, num_needles, key_len, value_len, marker_id=eod_id, id_range=ids,
                          seed=seed)
    stream, source = None, "random"
    if haystack == "heldout":
        try:
            stream = heldout_haystack(run, cfg.haystack_len, eod_id)
            source = "heldout"
        except (OSError, ValueError) as e:
            source = f"random (held-out data unavailable: {e})"
    return niah.generate_niah(stream, cfg, num_samples), niah.mixed_mode_schedule(cfg), source


def evaluate_retrieval(model, run: TrainConfig, task: str, num_samples: int = 64, seq_len: Optional[int] = None,
                       batch_size: int = 8, seed: int = 0, haystack: str = "heldout",
                       num_pairs: Optional[int] = None, num_queries: Optional[int] = None, num_needles: int = 1,
                       key_len: int = 2, value_len: int = 4, router: Optional[RouterSchedule] = None,
                       query_spans: Optional[int] = None, context_segments: Optional[int] = None) -> dict:
    """Accuracy of ``task`` ("mqar" or "niah") under all_attention, all_linear and mixed mode
    (one row each); ``seq_len``, ``num_pairs``, ``num_queries`` and MQAR's layout (``query_spans``,
    ``context_segments``: ``build_task``) default to the checkpoint's data.seq_length, data.mqar_*."""
    seq_len = seq_len or run.data.seq_length
    num_pairs = num_pairs or run.data.mqar_num_pairs
    num_queries = num_queries or run.data.mqar_num_queries
    sample, mixed, source = build_task(task, run, num_samples, seq_len, seed, haystack, num_pairs, num_queries,
                                       num_needles, key_len, value_len, query_spans, context_segments)
    vocab_size = dataset_vocab(run)[0]
    schedules = {"all_attention": all_attention(), "all_linear": all_linear(), "mixed": mixed,
                 **({str(router): router} if router else {})}
    rows = [dict(schedule=name, **answer_accuracy(model, sample, schedule, vocab_size, batch_size))
            for name, schedule in schedules.items()]
    result = dict(task=task, num_samples=num_samples, seq_len=seq_len, seed=seed,
                  mixed_schedule=str(mixed), rows=rows)
    if task == "mqar":
        result.update(num_pairs=num_pairs, num_queries=num_queries or num_pairs,
                      query_spans=mqar_layout(run, query_spans, context_segments)[0])
    else:
        result.update(num_needles=num_needles, key_len=key_len, value_len=value_len, haystack=source)
    return result
