"""The training run of ``oryx-train`` (``oryx_megatron.cli.train``): ``pretrain`` and its ``Trainer``.

The run, top to bottom (``Trainer``): parallel state -> model chunks in megatron DDP ->
optimizer and LR schedule -> data -> resume from `latest` -> loop [train step, log, eval,
save, preemption] -> final save, eval and loss-curve PNG. One step's pieces are in ``steps``;
router=joint's draws, loss terms, price and metrics in ``joint_routing``.
"""

import logging
import secrets
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from omegaconf import OmegaConf

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.data.modes import build_mode_schedule
from oryx_megatron.launch import REQUEUE_EXIT_CODE
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
from oryx_megatron.run_config import TrainConfig, train_iters
from oryx_megatron.source import git_source
from oryx_megatron.training.joint_routing import JointRouting
from oryx_megatron.training.metrics import MetricsLogger, memory_gb
from oryx_megatron.training.preemption import PreemptionHandler
from oryx_megatron.training.router import RouterTrainer, load_trained_weights
from oryx_megatron.training.saving import CheckpointSaver
from oryx_megatron.training.steps import (
    Interval,
    LossSpikeDetector,
    all_finite,
    clip_grads,
    forward_backward,
    loss_metrics,
    sum_losses,
)

logger = logging.getLogger("oryx_megatron.train")


def pretrain(run: TrainConfig, output_dir: str) -> int:
    """Train to train_iters, or for train.exit_interval more iterations (returns 0), or
    until preempted (saves, returns REQUEUE_EXIT_CODE)."""
    p = run.parallel
    initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, run.train.seed,
                        p.virtual_pipeline_model_parallel_size, p.distributed_timeout_minutes, p.context_parallel_size)
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
        # router=joint: the router's draws, loss terms, price and metrics (training/joint_routing.py)
        self.routing = JointRouting(run.router, self.model[0].module.router) if run.router.mode == "joint" else None
        self.matmul_params = _total_params(sum(flops.matmul_params(chunk) for chunk in self.model))
        self.metrics = MetricsLogger(self.is_logging_rank, run.logging, Path(self.output_dir),
                                     OmegaConf.to_container(OmegaConf.structured(run)))
        self.run_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))  # saved with every checkpoint
        self.run_id: Optional[str] = None  # the W&B run id, chosen (or read from the checkpoint) by resume
        self.source = git_source()  # the code this process runs, read now: the tree may change while it trains
        self.preemption = PreemptionHandler()
        self._resources.callback(self.preemption.restore)
        ckpt = run.checkpoint
        self.saver = CheckpointSaver(self.ckpt_dir, ckpt.async_save, ckpt.keep_last, ckpt.keep_every)
        self._resources.callback(self.saver.close)  # an error's way out: the writers end, `latest` stays
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
        elif self.run.router.mode == "joint" and self.run.router.init_from:  # a trained model, a new router
            logger.info("joint routing from the weights of %s",
                        load_trained_weights(self.model[0].module, self.run.router.init_from))
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
            self.log_saves(self.saver.poll())  # an async save whose writes have all finished completes
            interval.add(loss_sums, grad_norm)
            skipped = grad_norm is None
            skips_in_a_row = skips_in_a_row + 1 if skipped else 0
            if skipped:
                logger.warning("iteration %d: non-finite loss or gradient, optimizer step skipped (%d in a row)",
                               self.iteration, skips_in_a_row)
                if skips_in_a_row >= run.train.max_skipped_steps:
                    self.log(interval)
                    self.log_saves(self.saver.finish())  # the save in flight (of a good step) completes
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
        self.log_saves(self.saver.finish())  # before the exit for requeue too: `latest` names the last save
        if not exit_code and run.train.eval_interval is not None and last_eval != self.iteration:
            self.metrics.log(self.iteration, self.evaluate())
        png = self.metrics.finish()
        if self.is_logging_rank:
            logger.info("checkpoints: %s | outputs: %s | loss curve: %s", self.ckpt_dir, self.output_dir, png)
        return exit_code

    def train_step(self) -> Tuple[torch.Tensor, Optional[float]]:
        """One optimizer step over the global batch (micro-batched, pipelined) and one LR step;
        returns the loss sums (see ``sum_losses``) and the gradient norm. A non-finite loss or
        gradient norm on any rank skips the update (weights, optimizer state and LR schedule
        unchanged, as Megatron does on an fp16 overflow) on every rank: returns (zeros, None)."""
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        reports = forward_backward(self.run, self.model, self.loaders, forward_only=False, routing=self.routing)
        loss_sums = sum_losses(reports)
        found_inf = self.optimizer.prepare_grads()  # only an fp16 loss scaler checks; bf16/fp32 do not
        grad_norm = self.optimizer.get_grad_norm()
        self.iteration += 1
        if not all_finite(loss_sums, grad_norm, found_inf):
            return torch.zeros_like(loss_sums), None
        clip_grads(self.optimizer, grad_norm)
        self.optimizer.step_with_ready_grads()
        self.scheduler.step(increment=1)
        if self.routing is not None:  # the price of attention, from this step's routed tokens
            self.routing.after_step(reports)
        return loss_sums, grad_norm

    def log(self, interval: "Interval") -> None:
        """Means over the steps since the last log line: losses, grad norm, LR, throughput, memory."""
        elapsed, world = interval.seconds_per_step(), dist.get_world_size()
        report = loss_metrics(interval.loss_sums, "train") if interval.grad_norms else {}  # all skipped: no loss
        if self.routing is not None:  # router/attention_fraction (drawn: the FLOPs), read_fraction, price
            report.update(self.routing.metrics())
        step_flops = flops.train_step_flops(flops.step_shape(  # the attention term: the fraction of tokens read
            self.config, self.matmul_params, self.run.data.seq_length, self.run.train.global_batch_size,
            read_fraction=report.get("router/attention_fraction", report.get("train/attention_fraction", 1.0))))
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
                reports += forward_backward(self.run, self.model, loaders, forward_only=True)
            results[f"eval/loss_{name}"] = loss_metrics(sum_losses(reports), "eval")["eval/loss"]
        for chunk in self.model:
            chunk.train()
        return results

    def save(self) -> None:
        """A checkpoint of this iteration under checkpoint.dir (none without a dir): written now, or,
        with checkpoint.async_save, in the background (``saving``)."""
        if self.ckpt_dir:
            self.log_saves(self.saver.save(self.iteration, self.model, self.optimizer, self.scheduler,
                                           self.loaders[0], self.run_yaml,
                                           extra={"run_id": self.run_id, "source": self.source}))

    def log_saves(self, metrics: Dict[str, float]) -> None:
        """The checkpoint/ metrics of saves (``CheckpointSaver``), in a row of their own, at this iteration."""
        if metrics:
            self.metrics.log(self.iteration, metrics, console=False)


class NumericalFault(RuntimeError):
    """train.max_skipped_steps optimizer steps in a row had a non-finite loss or gradient."""


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

