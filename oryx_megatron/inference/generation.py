"""Batched generation with the Oryx inference cache.

Prompts of different lengths share one cache without padding: the shortest prompt length
is prefilled for the whole batch in one parallel forward, then every sequence advances one
position per step. A sequence still inside its prompt feeds its next prompt token (teacher
forcing; its logits are unused), the others feed their last sampled token. All caches stay
at the same position, so no attention mask and no padding token enter the states.

Two pieces: ``schedule_prompts`` lays the ragged prompts out with the mode of every position
(``RaggedBatch``); ``generate`` prefills, then steps the batch, sampling for the sequences
past their prompts (``_Sequences``).

A sequence finishes on a stop token (kept as its last output token, reason "stop") or after
``max_new_tokens`` (reason "length"). Finished sequences keep stepping with the batch, their
outputs frozen and their tokens left out of the stats, until every sequence is done.

The mode of position t of a sequence comes from the schedule (see ``schedules``); both
memories absorb every token whatever its mode.
"""

import dataclasses
import time
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.inference.sampling import Sampler, SamplingParams
from oryx_megatron.inference.schedules import as_inference_schedule


@dataclasses.dataclass
class GenerationStats:
    tokens_per_mode: Dict[str, int]  # tokens fed to the model by live sequences, by read mode
    prefill_tokens: int  # batch x shortest prompt, one parallel forward
    prefill_seconds: float
    decode_tokens: int  # tokens fed by live sequences in the one-token steps
    decode_seconds: float
    cache_bytes: Dict[str, int]  # kv / recurrent / conv, all layers, at the end

    @property
    def attention_fraction(self) -> float:
        return self.tokens_per_mode["attention"] / max(sum(self.tokens_per_mode.values()), 1)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_seconds, 1e-9)


@dataclasses.dataclass
class GenerationResult:
    tokens: List[List[int]]  # generated ids per prompt
    finish_reasons: List[str]  # "stop" | "length"
    stats: GenerationStats
    logits: Optional[List[Tensor]] = None  # per prompt [len(tokens[i]), vocab]: the logits each token came from


@dataclasses.dataclass
class RaggedBatch:
    """Prompts of different lengths laid out for lock-step decoding (see the module docstring)."""

    tokens: Tensor  # [b, span + 1] long: each prompt, then room for its generated tokens
    modes: Tensor  # [b, span] int8: the mode of every position ever fed; past its end a sequence repeats its last
    lengths: List[int]  # prompt lengths
    max_new_tokens: int

    @property
    def prefill_len(self) -> int:
        """Positions every sequence has in its prompt: prefilled in one parallel forward."""
        return min(self.lengths)


def schedule_prompts(prompts: Sequence[Sequence[int]], schedule, max_new_tokens: int, vocab_limit: int,
                     device: torch.device, max_length: Optional[int] = None) -> RaggedBatch:
    """Validate the prompts and lay them out with the schedule's mode of every position.
    ``max_length`` (the model's max_sequence_length): a prompt plus max_new_tokens must fit it."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must be a non-empty list of non-empty token lists")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    schedule = as_inference_schedule(schedule)
    lengths = [len(p) for p in prompts]
    if max_length is not None and max(lengths) + max_new_tokens > max_length:
        raise ValueError(f"a prompt of {max(lengths)} tokens + max_new_tokens {max_new_tokens} = "
                         f"{max(lengths) + max_new_tokens} exceeds max_sequence_length {max_length}")
    span = max(lengths) + max_new_tokens - 1  # positions ever fed
    tokens = torch.zeros(len(prompts), span + 1, dtype=torch.long)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)
    bad = tokens[(tokens < 0) | (tokens >= vocab_limit)]
    if bad.numel():
        raise ValueError(f"a prompt holds id {int(bad[0])}, outside [0, vocab_size={vocab_limit})")
    modes = np.stack([
        np.pad(schedule.position_modes(n, n + max_new_tokens - 1), (0, span - n - max_new_tokens + 1), mode="edge")
        for n in lengths
    ])
    return RaggedBatch(tokens.to(device), torch.from_numpy(modes).to(device), lengths, max_new_tokens)


class _Sequences:
    """What decoding has produced so far: each sequence's output tokens (and logits), and why it finished."""

    def __init__(self, batch: RaggedBatch, sampler: Sampler, stop_token_ids: Sequence[int], output_logits: bool):
        self.batch, self.sampler, self.stop = batch, sampler, set(stop_token_ids)
        b = len(batch.lengths)
        self.tokens: List[List[int]] = [[] for _ in range(b)]
        self.logits: Optional[List[List[Tensor]]] = [[] for _ in range(b)] if output_logits else None
        self.reasons: List[Optional[str]] = [None] * b

    def live(self) -> List[bool]:
        return [r is None for r in self.reasons]

    def emit(self, pos: int, logits: Tensor) -> None:
        """Sample position ``pos`` of every live sequence past its prompt from logits [b, V]."""
        batch = self.batch
        emit = [i for i, live in enumerate(self.live()) if live and pos >= batch.lengths[i]]
        if not emit:
            return
        for i, token in zip(emit, self.sampler(logits[emit]).tolist()):
            batch.tokens[i, pos] = token
            self.tokens[i].append(token)
            if self.logits is not None:
                self.logits[i].append(logits[i].clone())
            if token in self.stop:
                self.reasons[i] = "stop"
            elif len(self.tokens[i]) == batch.max_new_tokens:
                self.reasons[i] = "length"


def generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    schedule,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: Sequence[int] = (),
    vocab_size: Optional[int] = None,
    output_logits: bool = False,
) -> GenerationResult:
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    schedule: an InferenceSchedule, a data-layer ModeSchedule or a CLI string
    (``schedules.parse_schedule``); vocab_size: the tokenizer's, ids at or above it
    (the padded vocab) are never sampled. The model runs in eval mode, then gets its
    training flag back.
    """
    if not hasattr(model, "allocate_inference_cache"):
        raise TypeError(f"generate needs a model with an inference cache (OryxModel), got {type(model).__name__}")
    if not (getattr(model, "pre_process", True) and getattr(model, "post_process", True)):
        raise ValueError("generate needs the whole model on one pipeline stage (pipeline_model_parallel_size=1)")
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    limit = vocab_size if vocab_size is not None else model.vocab_size  # the padded vocab
    batch = schedule_prompts(prompts, schedule, max_new_tokens, limit, device)
    sequences = _Sequences(batch, Sampler(sampling, vocab_size, device), stop_token_ids, output_logits)
    b, t0 = len(batch.lengths), batch.prefill_len
    fed = torch.zeros(len(Mode), dtype=torch.long, device=device)  # tokens fed by live sequences, by mode

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            cache = model.allocate_inference_cache(b, dtype, device)
            start = time.perf_counter()
            logits = _next_logits(model, batch.tokens[:, :t0], batch.modes[:, :t0], cache)  # [b, vocab]
            fed += torch.bincount(batch.modes[:, :t0].flatten().long(), minlength=len(Mode))
            prefill_seconds, start = _elapsed(start, device), time.perf_counter()
            pos = t0  # the position predicted by `logits`
            while True:
                sequences.emit(pos, logits)
                live = torch.tensor(sequences.live(), device=device)
                if not live.any():
                    break
                logits = _next_logits(model, batch.tokens[:, pos : pos + 1], batch.modes[:, pos : pos + 1], cache)
                fed += torch.bincount(batch.modes[live, pos].long(), minlength=len(Mode))
                pos += 1
            decode_seconds = _elapsed(start, device)
    finally:
        model.train(was_training)

    counts = {m.name.lower(): int(n) for m, n in zip(Mode, fed.tolist())}
    stats = GenerationStats(
        tokens_per_mode=counts,
        prefill_tokens=b * t0,
        prefill_seconds=prefill_seconds,
        decode_tokens=sum(counts.values()) - b * t0,
        decode_seconds=decode_seconds,
        cache_bytes={key: sum(c.nbytes()[key] for c in cache) for key in ("kv", "recurrent", "conv")},
    )
    logits_out = [torch.stack(rows) for rows in sequences.logits] if output_logits else None
    return GenerationResult(sequences.tokens, sequences.reasons, stats, logits_out)


def _next_logits(model, ids: Tensor, modes: Tensor, cache) -> Tensor:
    """Feed ids/modes [b, s] through the cache; the full-vocab logits of the last position [b, V]."""
    logits = model(ids, modes, inference_cache=cache)[:, -1]
    if getattr(model, "parallel_output", False):
        logits = gather_from_tensor_model_parallel_region(logits)  # vocab shards -> full vocab (no-op at TP=1)
    return logits


def _elapsed(start: float, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
