"""oryx-train: pretrain an Oryx (or baseline) language model on megatron-core.

    oryx-train recipe=oryx_tg_130m checkpoint.dir=/ckpt/run1 optimizer.lr=3e-3
    torchrun --nproc-per-node 8 -m oryx_megatron.train recipe=oryx_tg_1_4b parallel.tensor_model_parallel_size=2
    oryx-train -m recipe=oryx_tg_130m optimizer.lr=1e-3,3e-3 hydra/launcher=slurm

The run, top to bottom (``Trainer``): parallel state -> model chunks in megatron DDP ->
optimizer and LR schedule -> data -> resume from `latest` -> loop [train step, log, eval,
save, preemption] -> final save, eval and loss-curve PNG.
"""

import collections
import logging
import math
import os
import secrets
import shutil
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from megatron.core import parallel_state
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from omegaconf import DictConfig, OmegaConf

from oryx_megatron import RECIPES_DIR
from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import Mode
from oryx_megatron.data.modes import build_mode_schedule
from oryx_megatron.launch import REQUEUE_EXIT_CODE, exit_for_requeue
from oryx_megatron.models import flops
from oryx_megatron.parallel import current_device, initialize_parallel
from oryx_megatron import checkpoint
from oryx_megatron.training import checkpointing
from oryx_megatron.training.builders import (
    build_loader,
    build_model_chunks,
    build_optimizer,
    build_scheduler,
    model_config,
)
from oryx_megatron.run_config import ConfigError, TrainConfig, load_train_config, train_iters
from oryx_megatron.training.validation import validate_run
from oryx_megatron.training.metrics import MetricsLogger, memory_gb
from oryx_megatron.training.preemption import PreemptionHandler
from oryx_megatron.training.router import RouterTrainer

logger = logging.getLogger("oryx_megatron.train")


@hydra.main(config_path=str(RECIPES_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run = _validated_run(cfg)  # a bad key, value or dataset fails here, before any process group or model
    output_dir = run.logging.output_dir or HydraConfig.get().runtime.output_dir
    if pretrain(run, output_dir) == REQUEUE_EXIT_CODE:
        exit_for_requeue()  # the checkpoint is complete on every rank


def _validated_run(cfg: DictConfig) -> TrainConfig:
    """The run config, checked (``validate_run``) before anything is built. A ConfigError is one
    line on stderr (``oryx-train: error: ...``), exit 2, and the run directory Hydra created for
    this invocation is removed; ``ORYX_DEBUG=1`` raises it with its traceback instead."""
    try:
        run = load_train_config(cfg)
        validate_run(run)
        return run
    except ConfigError as e:
        if os.environ.get("ORYX_DEBUG", "") not in ("", "0"):
            raise
        _remove_fresh_run_dir(HydraConfig.get().runtime.output_dir)
        print(f"oryx-train: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def _remove_fresh_run_dir(run_dir: str) -> None:
    """Remove Hydra's run directory if it holds nothing but what Hydra wrote at start (``.hydra/``
    and the job log); a directory with anything else (checkpoints, metrics) is left alone."""
    path = Path(run_dir)
    if not path.is_dir() or any(f.name != ".hydra" and not (f.is_file() and f.suffix == ".log")
                                for f in path.iterdir()):
        return
    shutil.rmtree(path, ignore_errors=True)
    date, runs = path.parent, path.parent.parent  # the default runs/<date>/<time>: those folders too, if now empty
    if runs.name == "runs":
        for folder in (date, runs):
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def pretrain(run: TrainConfig, output_dir: str) -> int:
    """Train to train_iters, or for train.exit_interval more iterations (returns 0), or
    until preempted (saves, returns REQUEUE_EXIT_CODE)."""
    p = run.parallel
    initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, run.train.seed,
                        p.virtual_pipeline_model_parallel_size, p.distributed_timeout_minutes)
    if run.router.mode == "posthoc":  # the router of a trained model, the rest frozen (training/router.py)
        with cuda_to_cpu(), RouterTrainer(run, output_dir) as trainer:
            trainer.train()
        return 0
    with cuda_to_cpu(), Trainer(run, output_dir) as trainer:  # cuda_to_cpu: megatron hard-codes CUDA (no-op with CUDA)
        trainer.resume()
        return trainer.train()


class Trainer:
    """One run of oryx-train on this rank, in the order it happens: build (model chunks in
    megatron DDP, optimizer, LR schedule, loaders, metrics), ``resume`` from the latest
    checkpoint, ``train``: ``train_step``, log, ``evaluate``, ``save`` until done or preempted.
    A context manager: leaving it closes the loaders and restores the signal handlers."""

    def __init__(self, run: TrainConfig, output_dir: str):
        self.run = run
        self.output_dir, self.ckpt_dir = _agree_on_paths(output_dir, run.checkpoint.dir)
        self.is_logging_rank = dist.get_rank() == dist.get_world_size() - 1  # on the last pipeline stage
        logger.setLevel(logging.INFO if self.is_logging_rank else logging.WARNING)
        logging.getLogger("megatron").setLevel(logging.WARNING)
        self._resources = ExitStack()  # the loaders' worker pools and the signal handlers: closed on exit
        try:
            self._build(run)
        except BaseException:
            self._resources.close()  # a failed build leaves no worker pool behind
            raise

    def _build(self, run: TrainConfig) -> None:
        """Model chunks, optimizer, LR schedule, loaders (train, and eval once per run), metrics."""
        self.config = model_config(run)
        self.model = build_model_chunks(run, self.config, current_device())
        self.optimizer = build_optimizer(run, self.model)
        self.scheduler = build_scheduler(run, self.optimizer)
        self.loaders = [self._open(build_loader(run)) for _ in self.model]  # one per virtual pipeline chunk
        _check_vocab(run, self.loaders[0])
        self.eval_loaders = {}  # schedule name -> (loaders, their state at the first window): built once, rewound
        if run.train.eval_interval is not None:
            for name in run.train.eval_schedules:
                schedule = build_mode_schedule(name)
                loaders = [self._open(build_loader(run, split="valid", mode_schedule=schedule)) for _ in self.model]
                self.eval_loaders[name] = (loaders, loaders[0].state_dict())

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # perf/memory_gb: this run's peak, not the process's
        self.iteration, self.total_iters = 0, train_iters(run)
        num_params = sum(p.numel() for chunk in self.model for p in chunk.parameters())
        self.tokens_per_iter = run.train.global_batch_size * run.data.seq_length
        self.matmul_params = _total_params(sum(flops.matmul_params(chunk) for chunk in self.model))
        self.metrics = MetricsLogger(self.is_logging_rank, run.logging, Path(self.output_dir),
                                     OmegaConf.to_container(OmegaConf.structured(run)))
        self.run_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))  # saved with every checkpoint
        self.run_id: Optional[str] = None  # the W&B run id, chosen (or read from the checkpoint) by resume
        self.preemption = PreemptionHandler()
        self._resources.callback(self.preemption.restore)
        logger.info("%s: %s parameters on this rank, %d iterations of %d tokens", run.model.family,
                    f"{num_params:,}", self.total_iters, self.tokens_per_iter)

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self._resources.close()

    def _open(self, loader):
        return self._resources.enter_context(loader)

    def resume(self) -> None:
        """Continue from the newest intact checkpoint of checkpoint.dir, if any (and
        checkpoint.load): `latest`'s, or, when that one is damaged, the newest older one that
        verifies (rank 0 chooses, logging what it skipped and why). Then the metrics continue at
        that iteration (later rows dropped) in the same W&B run (its id is in the checkpoint)."""
        ckpt = self.run.checkpoint
        checkpoint.check_retention(ckpt.keep_last, ckpt.keep_every)
        choice = [None, None]  # [checkpoint, W&B run id]
        if dist.get_rank() == 0:
            latest = checkpoint.latest_checkpoint(self.ckpt_dir) if ckpt.load else None
            saved_id = checkpoint.load_common(latest).get("run_id") if latest is not None else None
            choice = [latest and str(latest), saved_id or secrets.token_hex(4)]
        dist.broadcast_object_list(choice, src=0)
        latest, self.run_id = choice
        if latest is not None:
            self.iteration = checkpointing.load_checkpoint(Path(latest), self.model, self.optimizer,
                                                           self.scheduler, self.loaders[0])
            for loader in self.loaders[1:]:
                loader.load_state_dict(self.loaders[0].state_dict())
            logger.info("resumed from %s at iteration %d", latest, self.iteration)
        self.metrics.start(self.iteration, self.run_id)

    def train(self) -> int:
        """Step until train_iters (or exit_interval more steps): 0; or until preempted, after a
        save: REQUEUE_EXIT_CODE."""
        run = self.run
        stop_at = min(self.total_iters, self.iteration + (run.train.exit_interval or self.total_iters))
        first_iteration, exit_code, last_eval = self.iteration, 0, None
        interval = Interval()  # steps since the last log line
        skips_in_a_row, spikes = 0, LossSpikeDetector(run.train.loss_spike_window, run.train.loss_spike_threshold)
        while self.iteration < stop_at:
            loss_sums, grad_norm = self.train_step()
            interval.add(loss_sums, grad_norm)
            skipped = grad_norm is None
            skips_in_a_row = skips_in_a_row + 1 if skipped else 0
            if skipped:
                logger.warning("iteration %d: non-finite loss or gradient, optimizer step skipped (%d in a row)",
                               self.iteration, skips_in_a_row)
                if skips_in_a_row >= run.train.max_skipped_steps:
                    self.log(interval)
                    raise NumericalFault(
                        f"{skips_in_a_row} optimizer steps in a row skipped (non-finite loss or gradient, "
                        f"train.max_skipped_steps={run.train.max_skipped_steps}) at iteration {self.iteration}; "
                        f"stopping without saving: the last good checkpoint is "
                        f"{checkpoint.latest_checkpoint(self.ckpt_dir) if self.ckpt_dir else None}")
            elif loss_sums[1] > 0 and spikes.add(self.iteration, float(loss_sums[0] / loss_sums[1])):
                interval.spikes += 1
            if self.iteration % run.train.log_interval == 0 or self.iteration == stop_at:
                self.log(interval)
                interval = Interval()
            if run.train.eval_interval and self.iteration % run.train.eval_interval == 0:
                eval_start = time.perf_counter()
                self.metrics.log(self.iteration, self.evaluate())
                interval.start += time.perf_counter() - eval_start  # eval time is not training time
                last_eval = self.iteration
            if run.checkpoint.save_interval and self.iteration % run.checkpoint.save_interval == 0:
                if skips_in_a_row:  # keep the last good checkpoint as `latest` while steps are being skipped
                    logger.warning("iteration %d: not saving during %d skipped steps", self.iteration, skips_in_a_row)
                else:
                    self.save()
            if self.preemption.should_stop():
                logger.warning("%s received: saving and exiting for requeue", self.preemption.received or "signal")
                exit_code = REQUEUE_EXIT_CODE
                break

        saved = run.checkpoint.save_interval and self.iteration % run.checkpoint.save_interval == 0
        if self.iteration > first_iteration and not saved and (exit_code or run.checkpoint.save_at_end):
            self.save()
        if not exit_code and run.train.eval_interval is not None and last_eval != self.iteration:
            self.metrics.log(self.iteration, self.evaluate())
        png = self.metrics.finish()
        if self.is_logging_rank:
            logger.info("checkpoints: %s | outputs: %s | loss curve: %s", self.ckpt_dir, self.output_dir, png)
        return exit_code

    def train_step(self) -> Tuple[torch.Tensor, Optional[float]]:
        """One optimizer step over the global batch (micro-batched, pipelined) and one LR step;
        returns the loss sums (see ``_loss_sums``) and the gradient norm. A non-finite loss or
        gradient norm on any rank skips the update (weights, optimizer state and LR schedule
        unchanged, as Megatron does on an fp16 overflow) on every rank: returns (zeros, None)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = _forward_backward(self.run, self.model, self.loaders, forward_only=False)
        loss_sums = _loss_sums(reports)
        found_inf = self.optimizer.prepare_grads()  # only an fp16 loss scaler checks; bf16/fp32 do not
        grad_norm = self.optimizer.get_grad_norm()
        self.iteration += 1
        if not _all_finite(loss_sums, grad_norm, found_inf):
            return torch.zeros_like(loss_sums), None
        _clip_grads(self.optimizer, grad_norm)
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        if self.run.router.mode == "joint":  # the price of attention rises while the fraction exceeds the budget
            r, router = self.run.router, self.model[0].module.router
            fraction = float(loss_sums[3] / loss_sums[1]) if loss_sums[1] else 0.0
            router.price.copy_((router.price + r.price_lr * (fraction - r.budget)).clamp_min(0))
        return loss_sums, grad_norm

    def log(self, interval: "Interval") -> None:
        """Means over the steps since the last log line: losses, grad norm, LR, throughput, memory."""
        elapsed, world = interval.seconds_per_step(), dist.get_world_size()
        report = _loss_metrics(interval.loss_sums, "train") if interval.grad_norms else {}  # all skipped: no loss
        step_flops = flops.train_step_flops(flops.step_shape(  # the attention term: the fraction of tokens read
            self.config, self.matmul_params, self.run.data.seq_length, self.run.train.global_batch_size,
            read_fraction=report.get("train/attention_fraction", 1.0)))
        report.update({
            "train/grad_norm": interval.mean_grad_norm(),
            "train/lr": self.optimizer.param_groups[0]["lr"],
            "train/skipped_steps": interval.skipped,
            "train/loss_spikes": interval.spikes,
            "perf/tokens_per_s": self.tokens_per_iter / elapsed,
            "perf/tflops": step_flops / elapsed / world / 1e12,
            "perf/mfu": step_flops / elapsed / world / (self.run.logging.peak_tflops * 1e12),
            "perf/memory_gb": memory_gb(),
        })
        if self.run.router.mode == "joint":
            report["router/price"] = float(self.model[0].module.router.price)
        self.metrics.log(self.iteration, report)

    @torch.no_grad()
    def evaluate(self) -> Dict[str, float]:
        """Held-out loss under each eval schedule: the same windows every time, different modes."""
        for chunk in self.model:
            chunk.eval()
        results = {}
        for name, (loaders, start) in self.eval_loaders.items():
            for loader in loaders:
                loader.load_state_dict(start)
            reports = []
            for _ in range(self.run.train.eval_iters):
                reports += _forward_backward(self.run, self.model, loaders, forward_only=True)
            results[f"eval/loss_{name}"] = _loss_metrics(_loss_sums(reports), "eval")["eval/loss"]
        for chunk in self.model:
            chunk.train()
        return results

    def save(self) -> None:
        """A checkpoint of this iteration under checkpoint.dir (none without a dir)."""
        if self.ckpt_dir:
            ckpt = self.run.checkpoint
            path = checkpointing.save_checkpoint(self.ckpt_dir, self.iteration, self.model, self.optimizer,
                                                 self.scheduler, self.loaders[0], self.run_yaml,
                                                 keep_last=ckpt.keep_last, keep_every=ckpt.keep_every,
                                                 extra={"run_id": self.run_id})
            logger.info("saved %s", path)


def _forward_backward(run: TrainConfig, model, loaders, forward_only: bool) -> List[dict]:
    t = run.train
    num_microbatches = t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size())
    iterators = loaders if len(loaders) > 1 else loaders[0]
    joint = run.router.mode == "joint" and not forward_only  # evaluation keeps its schedules
    return get_forward_backward_func()(
        forward_step_func=partial(_routed_forward_step, run.model.router_chunk_size) if joint else _forward_step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=run.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=forward_only,
    )


def get_batch(data_iterator, device: torch.device) -> Dict[str, torch.Tensor]:
    """The next micro-batch on ``device``; to a GPU from pinned host memory, without blocking."""
    batch = next(data_iterator)
    pin = device.type == "cuda"
    return {key: (t.pin_memory() if pin else t).to(device, non_blocking=pin) for key, t in batch.items()}


def _forward_step(data_iterator, model):
    batch = get_batch(data_iterator, current_device())
    output = model(batch["tokens"], batch["modes"], labels=batch["labels"], document_ids=batch.get("document_ids"))
    return output, partial(_loss, batch["loss_mask"], batch["modes"])


def _routed_forward_step(chunk_size: int, data_iterator, model):
    """router=joint: each chunk's mode drawn from the router, p = sigmoid(logit), a ~ Bernoulli(p);
    the layers read with weights a + p - stop_gradient(p) (a in value: the LM loss reaches the router
    through attention read minus linear read, straight-through), and the loss adds the price of
    attention: price x each reading token's attention FLOPs (its position + 1, relative to the mean)."""
    batch = get_batch(data_iterator, current_device())
    tokens, docs = batch["tokens"], batch.get("document_ids")
    s = tokens.shape[1]
    router = model.module.router
    p = torch.sigmoid(model.module.route(tokens, chunk_size, docs).float())  # [b, n]
    weights = (torch.bernoulli(p.detach()) + p - p.detach()).repeat_interleave(chunk_size, dim=1)[:, :s]  # [b, s]
    flops = torch.arange(1, s + 1, device=tokens.device, dtype=torch.float32) / ((s + 1) / 2)  # [s], mean 1
    output = model(tokens, labels=batch["labels"], document_ids=docs, router_weights=weights)
    return output, partial(_loss, batch["loss_mask"], weights, attention_cost=router.price.float() * weights * flops)


def _loss(loss_mask, modes, per_token_loss, attention_cost=None):
    """Token-summed loss and token count (megatron divides by the global count), plus the
    sums over attention-mode tokens for per-mode logging. ``attention_cost`` [b, s] (router=joint):
    added to each masked token's loss (the reported sums stay the LM loss's)."""
    mask = loss_mask.float()
    losses = per_token_loss.float() * mask
    attention = (modes == Mode.ATTENTION).float() * mask
    total, count = losses.sum(), mask.sum()
    report = torch.stack([total, count, (losses * attention).sum(), attention.sum()]).detach()
    if attention_cost is not None:
        total = total + (attention_cost * mask).sum()
    return total, count.int(), {"loss_sums": report}


class Interval:
    """Loss sums, gradient norms and wall time of the steps since the last log line, and the
    steps skipped (non-finite) and loss spikes among them."""

    def __init__(self):
        self.start, self.loss_sums, self.grad_norms = time.perf_counter(), 0, []
        self.steps = self.skipped = self.spikes = 0

    def add(self, loss_sums: torch.Tensor, grad_norm: Optional[float]) -> None:
        """One step; ``grad_norm`` None: a skipped step (its loss is not averaged)."""
        self.steps += 1
        if grad_norm is None:
            self.skipped += 1
        else:
            self.loss_sums, self.grad_norms = self.loss_sums + loss_sums, self.grad_norms + [grad_norm]

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.start) / max(self.steps, 1)

    def mean_grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms) if self.grad_norms else float("nan")


class NumericalFault(RuntimeError):
    """train.max_skipped_steps optimizer steps in a row had a non-finite loss or gradient."""


class LossSpikeDetector:
    """Flags (logs) a loss above mean + ``threshold`` standard deviations of the previous
    ``window`` finite losses (once ``window // 2`` are known); threshold <= 0 disables it. A
    spike is only reported: the step is taken (a non-finite loss is skipped instead)."""

    def __init__(self, window: int, threshold: float):
        self.losses, self.threshold = collections.deque(maxlen=max(window, 2)), threshold

    def add(self, iteration: int, loss: float) -> bool:
        history, spike = self.losses, False
        if self.threshold > 0 and len(history) >= max(history.maxlen // 2, 2):
            mean = sum(history) / len(history)
            std = (sum((x - mean) ** 2 for x in history) / len(history)) ** 0.5
            if loss > mean + self.threshold * std:
                spike = True
                logger.warning("iteration %d: loss spike %.4f > mean %.4f + %g x std %.4f of the last %d steps",
                               iteration, loss, mean, self.threshold, std, len(history))
        history.append(loss)
        return spike


def _all_finite(loss_sums: torch.Tensor, grad_norm, found_inf: bool) -> bool:
    """Whether the loss and gradient norm are finite on every rank (one all-reduce)."""
    bad = bool(found_inf) or not torch.isfinite(loss_sums).all().item() or not math.isfinite(float(grad_norm))
    flag = torch.tensor([float(bad)], device=current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag.item() == 0


def _clip_grads(optimizer, grad_norm: float) -> None:
    """What megatron's ``optimizer.step()`` does between ``prepare_grads`` and the update:
    clip by the total norm already computed."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(opt, "is_stub_optimizer", False) else opt.get_parameters()
        if params and opt.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(params, max_norm=opt.config.clip_grad, total_norm=grad_norm,
                                         use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


def _loss_sums(reports: List[dict]) -> torch.Tensor:
    """[loss sum, tokens, attention-mode loss sum, attention-mode tokens] of the global batch
    (micro-batches summed, all-reduced over data-parallel ranks); zeros off the last stage."""
    sums = torch.zeros(4, dtype=torch.float64, device=current_device())
    if reports:
        sums = torch.stack([r["loss_sums"] for r in reports]).sum(0).double()
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
    return sums


def _loss_metrics(sums: torch.Tensor, split: str) -> Dict[str, float]:
    total, count, attn_total, attn_count = sums.tolist()
    if not count:  # not the last pipeline stage: nothing to report
        return {}
    lin_count = count - attn_count
    return {
        f"{split}/loss": total / count,
        f"{split}/loss_attention": attn_total / attn_count if attn_count else float("nan"),
        f"{split}/loss_linear": (total - attn_total) / lin_count if lin_count else float("nan"),
        f"{split}/attention_fraction": attn_count / count,
    }


def _agree_on_paths(output_dir: str, ckpt_dir):
    """Rank 0's output and checkpoint paths for everyone (ranks may resolve `now` differently)."""
    paths = [output_dir, ckpt_dir]
    dist.broadcast_object_list(paths, src=0)
    return paths


def _total_params(local: int) -> int:
    """Parameters of the whole model: this rank's, summed over one data-parallel replica."""
    n = torch.tensor([local if parallel_state.get_data_parallel_rank() == 0 else 0], dtype=torch.float64,
                     device=current_device())
    dist.all_reduce(n)
    return int(n.item())


def _check_vocab(run: TrainConfig, loader) -> None:
    data_vocab = getattr(loader, "vocab_size", None)
    if data_vocab is not None and data_vocab > run.model.vocab_size:
        raise ValueError(
            f"model.vocab_size={run.model.vocab_size} is smaller than the data's tokenizer "
            f"vocab ({data_vocab}, {run.data.data_path})"
        )


if __name__ == "__main__":
    # `python -m oryx_megatron.train`: run the importable module's main, so that a submitit sweep
    # pickles it by reference (cloudpickle copies __main__'s functions and classes by value).
    from oryx_megatron.train import main as importable_main

    importable_main()
