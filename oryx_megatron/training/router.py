"""Post-hoc router training (``router=posthoc``): a trained Oryx model is frozen and only its chunk
router (mixer/router.py) learns where reading attention pays.

    oryx-train router=posthoc router.init_from=runs/demo/checkpoints router.hidden=64

Per batch, top to bottom (``RouterTrainer.step``):

1. two forwards without gradient, every token reading linear, then every token reading attention:
   per-token losses; a chunk's **benefit** is the mean over its loss-masked tokens of the linear loss
   minus the attention loss (both memories absorb every token, so the two reads see the same context);
2. one routing pass (the router's logits from the first layer's reads of each chunk's first token, causal);
3. the router's loss over every chunk (``router_loss``): binary cross entropy against target =
   benefit > ``benefit_threshold`` (``classification``), or the squared error of the logit against
   (benefit - benefit_threshold) / ``temperature`` (``regression``): either way p >= 0.5 where the
   benefit is predicted above the threshold. A chunk without loss-masked tokens (the keys and values
   of a recall task) has benefit 0 and is never a target: attention there pays nothing of its own;
4. an AdamW step on the router's parameters (the model's stay as trained).

Logged every ``train.log_interval`` steps: router/loss, router/attention_fraction (of all tokens:
those in chunks with p >= 0.5), router/target_fraction, router/precision and router/recall against
the targets, and the LM loss at the router's fraction (router/loss_routed, a third forward with the
router's modes) beside router/loss_linear and router/loss_attention. At the end the router is calibrated on
held-out chunks (the percentiles of p: the thresholds ``router budget=B`` reads) and the model is
saved as a checkpoint of the run (model weights, router included; no optimizer state: a post-hoc
run is short and starts again rather than resumes).
"""

import logging
import time
from pathlib import Path
from typing import Dict, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import dist_checkpointing
from omegaconf import OmegaConf
from torch import Tensor

from oryx_megatron import checkpoint
from oryx_megatron.config import Mode
from oryx_megatron.models.builder import build_model
from oryx_megatron.parallel import current_device
from oryx_megatron.run_config import TrainConfig, train_iters
from oryx_megatron.training.builders import build_loader, model_config
from oryx_megatron.training.metrics import MetricsLogger

logger = logging.getLogger("oryx_megatron.train")


def chunk_means(values: Tensor, mask: Tensor, chunk_size: int) -> Tuple[Tensor, Tensor]:
    """Means over each chunk's masked positions of values [b, s] (mask [b, s]) and the positions
    counted: [b, n] each, n = ceil(s / chunk_size); a chunk with none has mean 0."""
    b, s = values.shape
    pad = -s % chunk_size
    total = F.pad(values * mask, (0, pad)).view(b, -1, chunk_size).sum(-1)
    count = F.pad(mask, (0, pad)).view(b, -1, chunk_size).sum(-1)
    return total / count.clamp_min(1), count


def router_targets(model, batch: Dict[str, Tensor], chunk_size: int) -> Tuple[Tensor, Tensor, Dict[str, Tensor]]:
    """(benefit [b, n] nats, loss-masked tokens per chunk [b, n], the two per-token losses [b, s])
    of a batch: from one all-linear and one all-attention forward."""
    docs = batch.get("document_ids")
    with torch.no_grad():
        losses = {mode: model(batch["tokens"], mode, labels=batch["labels"], document_ids=docs).float()
                  for mode in (Mode.LINEAR, Mode.ATTENTION)}
    mask = batch["loss_mask"].float()
    benefit, count = chunk_means(losses[Mode.LINEAR] - losses[Mode.ATTENTION], mask, chunk_size)
    return benefit, count, losses


class RouterTrainer:
    """One post-hoc router run on this process (tensor and pipeline parallel size 1)."""

    def __init__(self, run: TrainConfig, output_dir: str):
        self.run, self.output_dir = run, Path(output_dir)
        self.device = current_device()
        self.model = build_model(run.model, model_config(run)).to(self.device)
        self.chunk = run.router.chunk_size
        self.iterations = train_iters(run)
        start = load_trained_weights(self.model, run.router.init_from)
        logger.info("router: fitting the router of %s (frozen); %d iterations", start, self.iterations)
        for name, param in self.model.named_parameters():
            param.requires_grad_(name.startswith("router."))
        o = run.optimizer
        self.optimizer = torch.optim.AdamW(self.model.router.parameters(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                           eps=o.adam_eps, weight_decay=o.weight_decay)
        self.loader = build_loader(run)
        self.metrics = MetricsLogger(dist.get_rank() == 0, run.logging, self.output_dir,
                                     OmegaConf.to_container(OmegaConf.structured(run)))

    def __enter__(self) -> "RouterTrainer":
        return self

    def __exit__(self, *exc) -> None:
        self.loader.close()

    def train(self) -> None:
        self.metrics.start(0)
        sums, start = torch.zeros(METRIC_SUMS, dtype=torch.float64), time.perf_counter()
        for iteration in range(1, self.iterations + 1):
            sums += self.step(next(self.loader))
            if iteration % self.run.train.log_interval == 0 or iteration == self.iterations:
                self.metrics.log(iteration, {**router_metrics(sums), "perf/seconds_per_step":
                                             (time.perf_counter() - start) / self.run.train.log_interval})
                sums, start = torch.zeros(METRIC_SUMS, dtype=torch.float64), time.perf_counter()
        self.model.router.calibration.copy_(self.calibration())
        path = save_model(self.run, self.model, self.iterations)
        self.metrics.finish()
        logger.info("router: saved %s (calibration: p at the 50th / 90th percentile %.3f / %.3f)", path,
                    float(self.model.router.calibration[50]), float(self.model.router.calibration[90]))

    def step(self, batch: Dict[str, Tensor]) -> Tensor:
        """One optimizer step of the router; returns its sums for the metrics (``router_metrics``)."""
        batch = {key: t.to(self.device) for key, t in batch.items()}
        benefit, count, losses = router_targets(self.model, batch, self.chunk)
        logits = self.model.route(batch["tokens"], self.chunk, batch.get("document_ids"))  # [b, n] as benefit
        loss, target = router_loss(logits, benefit, count, self.run.router)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        attend = logits.detach() >= 0  # p >= 0.5
        with torch.no_grad():  # the LM loss at the router's fraction: a forward with its modes
            modes = torch.where(attend, Mode.ATTENTION, Mode.LINEAR).to(torch.int8)
            modes = modes.repeat_interleave(self.chunk, dim=1)[:, : batch["tokens"].shape[1]]
            routed = self.model(batch["tokens"], modes, labels=batch["labels"],
                                document_ids=batch.get("document_ids")).float()
        mask, seq = batch["loss_mask"].float(), batch["tokens"].shape[1]
        size = (seq - self.chunk * torch.arange(logits.shape[1], device=logits.device)).clamp(max=self.chunk)
        return torch.stack([
            loss.detach() * logits.numel(), logits.new_tensor(logits.numel()),  # router loss x chunks, chunks
            (attend * size).sum(), (target * size).sum(), logits.new_tensor(logits.shape[0] * seq),  # tokens
            (attend & target).sum(), attend.sum(), target.sum(),  # chunks: both, routed, target
            count.sum(),  # loss-masked tokens
            *((t * mask).sum() for t in (routed, losses[Mode.LINEAR], losses[Mode.ATTENTION])),  # LM loss sums
        ]).double().cpu()

    @torch.no_grad()
    def calibration(self) -> Tensor:
        """Percentiles 0..100 of p(attention) over the chunks of held-out batches (training batches
        when the run holds none out)."""
        try:
            loader = build_loader(self.run, split="valid")
        except (OSError, ValueError):  # no held-out split (train.eval_interval=null on one document)
            loader = build_loader(self.run)
        with loader:
            probs = [torch.sigmoid(self.model.route(b["tokens"].to(self.device), self.chunk,
                                                    None if "document_ids" not in b else b["document_ids"].to(self.device)))
                     .flatten().double().cpu() for b, _ in zip(loader, range(self.run.router.calibration_batches))]
        return torch.quantile(torch.cat(probs), torch.linspace(0, 1, 101, dtype=torch.float64))


METRIC_SUMS = 12  # the length of RouterTrainer.step's sums


def router_loss(logits: Tensor, benefit: Tensor, count: Tensor, r) -> Tuple[Tensor, Tensor]:
    """(the router's loss, mean over every chunk; its targets [b, n] bool) from its logits [b, n], the
    chunks' benefits [b, n] and loss-masked token counts [b, n] (``router_targets``); ``r`` is the
    run's ``router`` config. A chunk without loss-masked tokens (benefit 0) is never a target."""
    target = (benefit > r.benefit_threshold) & (count > 0)
    if r.objective == "classification":
        per_chunk = F.binary_cross_entropy_with_logits(logits.float(), target.float(), reduction="none")
    else:
        per_chunk = (logits.float() - (benefit - r.benefit_threshold) / r.temperature) ** 2
    return per_chunk.mean(), target


def router_metrics(sums: Tensor) -> Dict[str, float]:
    """The logged metrics from the summed step sums."""
    (loss, chunks, routed_tokens, target_tokens, tokens, hits, routed_chunks, target_chunks, loss_tokens,
     routed, linear, attention) = sums.tolist()
    return {
        "router/loss": loss / max(chunks, 1),
        "router/attention_fraction": routed_tokens / max(tokens, 1),
        "router/target_fraction": target_tokens / max(tokens, 1),
        "router/precision": hits / routed_chunks if routed_chunks else float("nan"),
        "router/recall": hits / target_chunks if target_chunks else float("nan"),
        "router/loss_routed": routed / max(loss_tokens, 1),
        "router/loss_linear": linear / max(loss_tokens, 1),
        "router/loss_attention": attention / max(loss_tokens, 1),
    }


def load_trained_weights(model, init_from: str) -> Path:
    """The trained model's weights (all but the router's, which it does not have) from ``init_from``:
    a checkpoint, or a run's checkpoint.dir (its `latest`); frozen by post-hoc training, trained on by
    joint training. Returns the checkpoint read."""
    path = Path(init_from)
    if not (path / checkpoint.RUN_CONFIG).exists():
        path = checkpoint.latest_checkpoint(init_from, fallback=False)
        if path is None:
            raise FileNotFoundError(f"router.init_from={init_from}: neither a checkpoint nor a checkpoint dir "
                                    "with `latest`")
    checkpoint.verify_checkpoint(path)
    whole = model.sharded_state_dict()
    sharded = {k: v for k, v in whole.items() if not k.startswith("router.")}
    state = checkpoint.load_sharded({"model": sharded}, path, model_keys=checkpoint.sharded_keys(whole))["model"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    router_only = all(k.startswith("router.") for k in missing) and not unexpected
    if not router_only:
        raise ValueError(f"router.init_from={init_from}: its model differs from this recipe's "
                         f"(missing {[k for k in missing if not k.startswith('router.')][:3]}, unexpected {unexpected[:3]})")
    return path


def save_model(run: TrainConfig, model, iteration: int) -> Path:
    """The model (router included) as a checkpoint of checkpoint.dir that oryx-generate and
    oryx-eval read: megatron's files, run_config.yaml, the checksums, then `latest`."""
    path = checkpoint.iteration_dir(run.checkpoint.dir, iteration)
    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save({"model": model.sharded_state_dict(), "iteration": iteration, "layout": [1, 1, 1]},
                            str(path))
    (path / checkpoint.RUN_CONFIG).write_text(OmegaConf.to_yaml(OmegaConf.structured(run)))
    checkpoint.write_checksums(path)
    (Path(run.checkpoint.dir) / checkpoint.LATEST).write_text(path.name + "\n")
    return path
