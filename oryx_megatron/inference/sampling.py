"""Next-token sampling: greedy, temperature, top-k and top-p, in fp32 with a seeded generator.

Order (as Hugging Face): ids >= the tokenizer's vocab size are masked, then temperature,
top-k, top-p; temperature 0 is greedy (argmax). Top-k keeps every id whose logit ties
with the k-th largest. Top-p keeps the smallest set of most likely ids whose probability
reaches ``top_p`` (an id is kept while the mass of the ids ranked above it is < top_p).
"""

import dataclasses
from typing import Optional

import torch
from torch import Tensor


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # keep the k most likely ids; 0: off
    top_p: float = 1.0  # nucleus mass; 1: off
    seed: int = 0  # seeds the generator of one generate() call

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")


def mask_vocab(logits: Tensor, vocab_size: Optional[int]) -> Tensor:
    """[n, V] -> [n, V] with the padded ids (>= vocab_size) at -inf."""
    if vocab_size is None or vocab_size >= logits.shape[-1]:
        return logits
    return logits.index_fill(-1, torch.arange(vocab_size, logits.shape[-1], device=logits.device), float("-inf"))


def top_k_mask(logits: Tensor, k: int) -> Tensor:
    """bool [n, V]: True for the ids kept by top-k (ties with the k-th largest kept)."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits >= kth


def top_p_mask(logits: Tensor, p: float) -> Tensor:
    """bool [n, V]: True for the ids of the smallest most-likely set with mass >= p."""
    probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    keep_sorted = probs.cumsum(-1) - probs < p  # mass ranked above each id
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def filter_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k and top-p as -inf: [n, V] fp32 -> [n, V] (temperature > 0)."""
    logits = logits / params.temperature
    if params.top_k > 0:
        logits = logits.masked_fill(~top_k_mask(logits, params.top_k), float("-inf"))
    if params.top_p < 1:
        logits = logits.masked_fill(~top_p_mask(logits, params.top_p), float("-inf"))
    return logits


class Sampler:
    """Draws next ids from logits [n, V]; one seeded generator per instance."""

    def __init__(self, params: SamplingParams, vocab_size: Optional[int] = None, device=None):
        self.params, self.vocab_size = params, vocab_size
        self.generator = torch.Generator(device=device or "cpu").manual_seed(params.seed)

    def probs(self, logits: Tensor) -> Tensor:
        """[n, V] -> fp32 [n, V]: the distribution ids are drawn from (one-hot argmax when greedy)."""
        logits = mask_vocab(logits.float(), self.vocab_size)
        if self.params.temperature == 0:
            return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        return torch.softmax(filter_logits(logits, self.params), dim=-1)

    def __call__(self, logits: Tensor) -> Tensor:
        """[n, V] -> int64 [n]."""
        if self.params.temperature == 0:
            return mask_vocab(logits.float(), self.vocab_size).argmax(-1)
        return self.draw(self.probs(logits))

    def draw(self, probs: Tensor) -> Tensor:
        """One id per row of probs [n, V] (unnormalised is fine) -> int64 [n]."""
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]
