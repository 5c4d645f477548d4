"""lm-evaluation-harness adapter: a loaded Oryx model and tokenizer as an lm-eval ``LM``.

``OryxLM(model, tokenizer, schedule, batch_size, max_length)`` answers lm-eval's requests;
the model ``oryx`` of lm-eval's registry, built from a checkpoint path (``model_args``) and its
dataset's tokenizer, is ``oryx_megatron.eval.lm_eval_harness``; its command line
``oryx_megatron.cli.lm_eval``.

Modes follow ``oryx_megatron.inference`` exactly: for a (context, continuation) pair the
context is the prompt and the continuation the generated tokens, so the fed tokens are
``context + continuation[:-1]`` with modes ``schedule.position_modes(len(context),
len(context) + len(continuation) - 1)``, the modes ``generate`` would use to produce that
continuation.

All of a request's log-probs come from one parallel forward and are the model's own: the
softmax runs over the model's (padded) vocab, as in its training loss. ``loglikelihood_rolling``
scores every token of a text given the EOD token (the prompt); texts longer than max_length
are scored in lm-eval's disjoint rolling windows, each window's context as its prompt.
"""

from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from oryx_megatron.inference import SamplingParams, as_inference_schedule, generate
from oryx_megatron.inference.forward import eval_mode

DEFAULT_MAX_GEN_TOKS = 256


def pair_modes(schedule, context_len: int, continuation_len: int) -> np.ndarray:
    """int8 [context_len + continuation_len - 1]: the modes of the fed tokens of a pair."""
    return as_inference_schedule(schedule).position_modes(context_len, context_len + continuation_len - 1)


def continuation_logprobs(model, sequences: Sequence[Tuple[Sequence[int], Sequence[int]]],
                          schedule) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """For each (context, continuation): (log-prob [len(continuation)] fp32 of each
    continuation token, whether it is the argmax [len(continuation)] bool), from one parallel
    forward of the batch (right-padded; the model is causal, so padding never reaches a scored
    position)."""
    schedule = as_inference_schedule(schedule)
    device = next(model.parameters()).device
    lengths = [len(c) + len(x) - 1 for c, x in sequences]
    s = max(lengths)
    tokens = torch.zeros(len(sequences), s, dtype=torch.long)
    modes = torch.zeros(len(sequences), s, dtype=torch.int8)
    for i, (context, continuation) in enumerate(sequences):
        if not context or not continuation:
            raise ValueError("context and continuation must both hold at least one token")
        fed = list(context) + list(continuation)[:-1]
        tokens[i, : len(fed)] = torch.as_tensor(fed, dtype=torch.long)
        row = torch.from_numpy(pair_modes(schedule, len(context), len(continuation)))
        modes[i, : len(fed)] = row
        modes[i, len(fed):] = row[-1]
    with eval_mode(model):
        logits = model(tokens.to(device), modes.to(device))  # [b, s, padded vocab]
    if getattr(model, "parallel_output", False):
        logits = gather_from_tensor_model_parallel_region(logits)
    logprobs = F.log_softmax(logits.float(), dim=-1)
    out = []
    for i, (context, continuation) in enumerate(sequences):
        rows = logprobs[i, len(context) - 1 : lengths[i]]  # the reads that predict the continuation
        target = torch.as_tensor(list(continuation), dtype=torch.long, device=rows.device)
        out.append((rows.gather(-1, target[:, None])[:, 0].cpu(), (rows.argmax(-1) == target).cpu()))
    return out


def score_continuation(model, context_ids: Sequence[int], continuation_ids: Sequence[int],
                       schedule) -> Tuple[float, bool]:
    """(sum of the continuation's log-probs, whether every continuation token is greedy)."""
    logprobs, greedy = continuation_logprobs(model, [(context_ids, continuation_ids)], schedule)[0]
    return float(logprobs.sum()), bool(greedy.all())


class OryxLM(LM):
    """lm-eval's requests answered by ``model`` (on its device, TP = PP = 1) under ``schedule``
    (an inference schedule or its text form); ``tokenizer`` has ``encode_batch``, ``decode``,
    ``vocab_size`` and ``eod_id`` (``data_prep.tokenizer``'s); ``max_length`` defaults to the
    model's max_sequence_length."""

    def __init__(self, model, tokenizer, schedule="all_attention", batch_size=1, max_length: Optional[int] = None):
        super().__init__()
        self.schedule = as_inference_schedule(schedule)
        try:
            self.batch_size = max(1, int(batch_size))
        except (TypeError, ValueError):  # "auto": not supported, one request at a time
            self.batch_size = 1
        self.model = model
        self._device = next(model.parameters()).device
        self.tokenizer = tokenizer
        self.vocab_size = self.tokenizer.vocab_size
        self.eod_id = self.tokenizer.eod_id
        self.max_length = int(max_length) if max_length is not None else int(model.max_sequence_length)

    # ---- tokenization ----
    def tok_encode(self, text: str) -> List[int]:
        return [int(i) for i in self.tokenizer.encode_batch([text])[0]] if text else []

    def tok_decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """lm-eval's split: trailing spaces of the context move to the continuation, the pair is
        encoded whole and the context's tokens cut off; an empty context becomes [EOD]."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            continuation = context[-spaces:] + continuation
            context = context[:-spaces]
        if not context:
            return [self.eod_id], self.tok_encode(continuation)
        whole = self.tok_encode(context + continuation)
        n = len(self.tok_encode(context))
        return whole[:n], whole[n:]

    def _truncate(self, context: List[int], continuation: List[int]) -> Tuple[List[int], List[int]]:
        """Left-truncate so that the fed tokens fit in max_length."""
        continuation = continuation[-self.max_length:]
        keep = max(self.max_length + 1 - len(continuation), 1)
        return context[-keep:], continuation

    # ---- lm-eval requests ----
    def _score_pairs(self, pairs: List[Tuple[List[int], List[int]]]) -> List[Tuple[float, bool]]:
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        results: List[Optional[Tuple[float, bool]]] = [None] * len(pairs)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            scored = continuation_logprobs(self.model, [pairs[i] for i in chunk], self.schedule)
            for i, (logprobs, greedy) in zip(chunk, scored):
                results[i] = (float(logprobs.sum()), bool(greedy.all()))
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> List[Tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = request.args
            ctx, cont = self._truncate(*self._encode_pair(context, continuation))
            if not cont:
                raise ValueError(f"continuation {continuation!r} encodes to no tokens")
            pairs.append((ctx, cont))
        results = self._score_pairs(pairs)
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        out = []
        for request in requests:
            (text,) = request.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.eod_id,
                max_seq_len=self.max_length, context_len=1)]
            total = sum(logprob for logprob, _ in self._score_pairs(windows)) if windows else 0.0
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        out: List[Optional[str]] = [None] * len(requests)
        for start in range(0, len(requests), self.batch_size):
            chunk = list(range(start, min(start + self.batch_size, len(requests))))
            # one generate() call per distinct set of generation kwargs within the chunk
            groups = {}
            for i in chunk:
                context, kwargs = requests[i].args
                kwargs = dict(kwargs or {})
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_gen = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
                temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
                key = (tuple(until), max_gen, temperature)
                groups.setdefault(key, []).append((i, context))
            for (until, max_gen, temperature), items in groups.items():
                stops = [self.eod_id]
                for text in until:
                    ids = self.tok_encode(text)
                    if len(ids) == 1:
                        stops.append(ids[0])
                keep = max(self.max_length - max_gen + 1, 1)
                prompts = [(self.tok_encode(context) or [self.eod_id])[-keep:] for _, context in items]
                result = generate(self.model, prompts, self.schedule, max_gen,
                                  sampling=SamplingParams(temperature=temperature),
                                  stop_token_ids=stops, vocab_size=self.vocab_size)
                for (i, context), tokens in zip(items, result.tokens):
                    tokens = [t for t in tokens if t != self.eod_id]
                    text = self.tok_decode(tokens)
                    for stop in until:
                        if stop:
                            text = text.split(stop)[0]
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out
