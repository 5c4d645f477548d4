"""Joint routing (``router=joint``, docs/routing.md): the chunk router chooses each chunk's mode while the model
trains, and learns where reading attention pays against the price of attention, which holds the budget.

``JointRouting`` is all of it, and the loop calls it in one place per step: megatron's pipeline schedule runs its
``forward_step`` (each chunk's mode drawn from the router, the loss with the router's terms, ``routed_loss_func``);
``after_step`` (the step taken) updates the price from the step's routed-token counts and keeps them for
``metrics``, the router's line of each log.
"""

from functools import partial
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from torch import Tensor

from oryx_megatron.config import RouterConfig
from oryx_megatron.mixer.router import ROUTER_THRESHOLD
from oryx_megatron.parallel import current_device, this_rank_tokens
from oryx_megatron.training.steps import get_batch, loss_func


class JointRouting:
    """router=joint for the model whose router is ``router`` (a ``ChunkRouter``: its ``price`` buffer is the price of
    attention), as ``config`` (the run's ``router`` group: chunk_size, estimator, budget, price_lr) sets it."""

    def __init__(self, config: RouterConfig, router: torch.nn.Module):
        self.config, self.router = config, router
        self.routed: Optional[Tensor] = None  # [tokens drawn to attention, p >= 0.5, tokens] since the last metrics

    def forward_step(self, data_iterator, model):
        """Megatron's forward step: each chunk's mode drawn from the router, p = sigmoid(logit), a ~ Bernoulli(p), and
        the loss with the price of attention: price x each reading token's attention FLOPs (its position + 1,
        relative to the mean), over every token (a task whose loss covers its answers only still pays for attention
        on its context). The router's gradient (``config.estimator``):

        - straight_through: the layers read with weights a + p - stop_gradient(p): in value the drawn modes, in the
          backward the LM loss's derivative in the read's weight (attention read minus linear read);
        - score_function: the layers read the drawn modes a; the router's gradient is that of log P(a) x (each
          token's loss and price - the micro-batch's mean at its position), summed over the chunk's tokens
          (REINFORCE with a baseline: the measured change, not its linear estimate).

        The report counts the tokens with p >= 0.5 too: what inference reads, and what the price follows."""
        chunk_size = self.config.chunk_size
        batch = get_batch(data_iterator, current_device())
        docs, s = batch.get("document_ids"), batch["tokens"].shape[1]
        flops = torch.arange(1, s + 1, device=batch["tokens"].device, dtype=torch.float32) / ((s + 1) / 2)  # mean 1
        local = this_rank_tokens(tokens=batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                                 flops=flops.expand_as(batch["tokens"]))
        logits = model.module.route(local["tokens"], chunk_size, docs).float()  # [b, n]: every chunk's
        p = torch.sigmoid(logits)
        drawn = torch.bernoulli(p.detach())  # [b, n]
        per_token = {"reads": p.detach() >= ROUTER_THRESHOLD}  # the modes inference reads
        if self.config.estimator == "score_function":
            per_token.update(weights=drawn,
                             log_prob=torch.where(drawn > 0, F.logsigmoid(logits), F.logsigmoid(-logits)))
        else:
            per_token.update(weights=drawn + p - p.detach())
        per_token = {k: v.repeat_interleave(chunk_size, dim=1)[:, :s] for k, v in per_token.items()}  # [b, s]
        output = model(local["tokens"], labels=local["labels"], document_ids=docs, router_weights=per_token["weights"])
        routed = this_rank_tokens(**per_token)
        return output, partial(routed_loss_func, local["loss_mask"], routed["weights"],
                               attention_cost=self.router.price.float() * routed["weights"] * local["flops"],
                               reads_at_inference=routed["reads"], log_prob=routed.get("log_prob"))

    def after_step(self, reports: List[dict]) -> None:
        """After an optimizer step over ``reports`` (the micro-batches' loss reports): the price of attention rises
        while the share read at inference (p >= 0.5, of every token of the global batch: counts all-reduced over the
        data- and context-parallel ranks) exceeds the budget, by dual ascent: price <- max(0, price + price_lr x
        (share - budget))."""
        routed = torch.stack([report["routed_tokens"] for report in reports]).sum(0)  # [drawn, p >= 0.5, all]
        dist.all_reduce(routed, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        fraction = float(routed[1] / routed[2])  # what inference reads: the drawn share is ~mean p, not it
        price, c = self.router.price, self.config
        price.copy_((price + c.price_lr * (fraction - c.budget)).clamp_min(0))
        self.routed = routed if self.routed is None else self.routed + routed

    def metrics(self) -> Dict[str, float]:
        """The router's metrics since the last call, of every token: router/attention_fraction (drawn: what training
        computes, and what the FLOP count reads), router/read_fraction (p >= 0.5: what the price follows), and
        router/price; the fractions only where a step was taken since."""
        report = {}
        if self.routed is not None:
            routed, self.routed = self.routed, None
            report["router/attention_fraction"] = float(routed[0] / routed[2])
            report["router/read_fraction"] = float(routed[1] / routed[2])
        report["router/price"] = float(self.router.price)
        return report


def routed_loss_func(loss_mask: Tensor, weights: Tensor, per_token_loss: Tensor, attention_cost: Tensor,
                     reads_at_inference: Tensor, log_prob: Optional[Tensor] = None):
    """``steps.loss_func`` of a micro-batch read with the router's ``weights`` [b, s] (0/1 in value) plus the router's
    terms: ``attention_cost`` [b, s] added to the loss, summed over every token (the reported sums stay the LM
    loss's), and the report's ``routed_tokens``: [tokens reading attention (drawn), tokens with p >= 0.5
    (``reads_at_inference`` [b, s], bool), tokens], every token counted. ``log_prob`` [b, s] (the score-function
    estimator): log P(drawn mode) of each token's chunk; adds zero to the loss in value and the gradient of
    sum(log_prob x (each token's loss and cost - the mean over the batch at its position))."""
    total, count, report = loss_func(loss_mask, weights, per_token_loss)
    losses = per_token_loss.float() * loss_mask.float()
    reads_attention = weights.detach() > 0.5  # a + p - p.detach(): 0/1 up to rounding (1 + p - p is not always 1)
    report["routed_tokens"] = torch.tensor([reads_attention.sum(), reads_at_inference.sum(), reads_attention.numel()],
                                           dtype=torch.float64, device=loss_mask.device)
    total = total + attention_cost.sum()
    if log_prob is not None:
        cost = (losses + attention_cost).detach()  # [b, s]
        surrogate = (log_prob * (cost - cost.mean(0, keepdim=True))).sum()
        total = total + surrogate - surrogate.detach()
    return total, count, report
