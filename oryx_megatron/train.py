"""oryx-train: pretrain an Oryx (or baseline) language model on megatron-core.

    oryx-train recipe=oryx_tg_130m checkpoint.dir=/ckpt/run1 optimizer.lr=3e-3
    torchrun --nproc-per-node 8 -m oryx_megatron.train recipe=oryx_tg_1_4b parallel.tensor_model_parallel_size=2
    oryx-train -m recipe=oryx_tg_130m optimizer.lr=1e-3,3e-3 hydra/launcher=slurm

The run, top to bottom: parallel state -> model chunks in megatron DDP -> optimizer and
LR schedule -> data -> resume from `latest` -> loop [train step, log, eval, save,
preemption] -> final save, eval and loss-curve PNG.
"""

import logging
import time
from functools import partial
from pathlib import Path
from typing import Dict, List

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from omegaconf import DictConfig, OmegaConf

from oryx_megatron import RECIPES_DIR
from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.data.modes import Mode, build_mode_schedule
from oryx_megatron.launch import REQUEUE_EXIT_CODE, exit_for_requeue
from oryx_megatron.parallel import initialize_parallel
from oryx_megatron.training import checkpointing
from oryx_megatron.training.builders import (
    build_loader,
    build_model_chunks,
    build_optimizer,
    build_scheduler,
    model_config,
)
from oryx_megatron.training.config import TrainConfig, load_train_config, train_iters
from oryx_megatron.training.metrics import MetricsLogger, flops_per_token, memory_gb
from oryx_megatron.training.preemption import PreemptionHandler

logger = logging.getLogger("oryx_megatron.train")


@hydra.main(config_path=str(RECIPES_DIR), config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run = load_train_config(cfg)  # a bad key or value fails here, before any process group
    output_dir = run.logging.output_dir or HydraConfig.get().runtime.output_dir
    if pretrain(run, output_dir) == REQUEUE_EXIT_CODE:
        exit_for_requeue()  # the checkpoint is complete on every rank


def pretrain(run: TrainConfig, output_dir: str) -> int:
    """Train to train_iters, or for train.exit_interval more iterations (returns 0), or
    until preempted (saves, returns REQUEUE_EXIT_CODE)."""
    p = run.parallel
    initialize_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, run.train.seed,
                        p.virtual_pipeline_model_parallel_size)
    output_dir, ckpt_dir = _agree_on_paths(output_dir, run.checkpoint.dir)
    is_logging_rank = dist.get_rank() == dist.get_world_size() - 1  # on the last pipeline stage
    logger.setLevel(logging.INFO if is_logging_rank else logging.WARNING)
    logging.getLogger("megatron").setLevel(logging.WARNING)
    run_yaml = OmegaConf.to_yaml(OmegaConf.structured(run))

    with cuda_to_cpu():  # megatron's optimizer and DDP hard-code CUDA tensors (no-op with CUDA)
        config = model_config(run)
        model = build_model_chunks(run, config)
        optimizer = build_optimizer(run, model)
        scheduler = build_scheduler(run, optimizer)
        loaders = [build_loader(run) for _ in model]  # one per virtual pipeline chunk
        _check_vocab(run, loaders[0])

        iteration, total_iters = 0, train_iters(run)
        latest = checkpointing.latest_checkpoint(ckpt_dir) if run.checkpoint.load else None
        if latest is not None:
            iteration = checkpointing.load_checkpoint(latest, model, optimizer, scheduler, loaders[0])
            for loader in loaders[1:]:
                loader.load_state_dict(loaders[0].state_dict())
            logger.info("resumed from %s at iteration %d", latest, iteration)

        num_params = sum(p.numel() for chunk in model for p in chunk.parameters())
        tokens_per_iter = run.train.global_batch_size * run.data.seq_length
        flops_per_iter = flops_per_token(config, run.data.seq_length, _total_params(num_params),
                                         run.model.vocab_size, run.model.share_embeddings_and_output_weights)
        flops_per_iter *= tokens_per_iter
        metrics = MetricsLogger(is_logging_rank, run.logging, Path(output_dir), OmegaConf.to_container(
            OmegaConf.structured(run)))
        logger.info("%s: %s parameters on this rank, %d iterations of %d tokens", run.model.family,
                    f"{num_params:,}", total_iters, tokens_per_iter)
        preemption = PreemptionHandler()
        save = partial(_save, ckpt_dir, model, optimizer, scheduler, loaders[0], run_yaml)
        stop_at = min(total_iters, iteration + (run.train.exit_interval or total_iters))
        first_iteration, exit_code, last_eval = iteration, 0, None
        interval = Interval()  # steps since the last log line

        while iteration < stop_at:
            loss_sums, grad_norm = train_step(run, model, optimizer, loaders)
            scheduler.step(increment=1)
            iteration += 1
            interval.add(loss_sums, grad_norm)
            if iteration % run.train.log_interval == 0 or iteration == stop_at:  # means over the interval
                elapsed, world = interval.seconds_per_step(), dist.get_world_size()
                report = _loss_metrics(interval.loss_sums, "train")
                report.update({
                    "train/grad_norm": interval.mean_grad_norm(),
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "perf/tokens_per_s": tokens_per_iter / elapsed,
                    "perf/tflops": flops_per_iter / elapsed / world / 1e12,
                    "perf/mfu": flops_per_iter / elapsed / world / (run.logging.peak_tflops * 1e12),
                    "perf/memory_gb": memory_gb(),
                })
                metrics.log(iteration, report)
                interval = Interval()
            if run.train.eval_interval and iteration % run.train.eval_interval == 0:
                eval_start = time.perf_counter()
                metrics.log(iteration, evaluate(run, model))
                interval.start += time.perf_counter() - eval_start  # eval time is not training time
                last_eval = iteration
            if run.checkpoint.save_interval and iteration % run.checkpoint.save_interval == 0:
                save(iteration)
            if preemption.should_stop():
                logger.warning("%s received: saving and exiting for requeue", preemption.received or "signal")
                exit_code = REQUEUE_EXIT_CODE
                break

        saved = run.checkpoint.save_interval and iteration % run.checkpoint.save_interval == 0
        if iteration > first_iteration and not saved and (exit_code or run.checkpoint.save_at_end):
            save(iteration)
        if not exit_code and run.train.eval_interval is not None and last_eval != iteration:
            metrics.log(iteration, evaluate(run, model))
        preemption.restore()
        png = metrics.finish()
    if is_logging_rank:
        logger.info("checkpoints: %s | outputs: %s | loss curve: %s", ckpt_dir, output_dir, png)
    return exit_code


def train_step(run: TrainConfig, model, optimizer, loaders):
    """One optimizer step over the global batch (micro-batched, pipelined); returns the loss
    sums (see ``_loss_sums``) and the gradient norm."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    reports = _forward_backward(run, model, loaders, forward_only=False)
    _, grad_norm, _ = optimizer.step()
    return _loss_sums(reports), grad_norm


@torch.no_grad()
def evaluate(run: TrainConfig, model) -> Dict[str, float]:
    """Held-out loss under each eval schedule (same windows, different modes)."""
    for chunk in model:
        chunk.eval()
    results = {}
    for name in run.train.eval_schedules:
        schedule = build_mode_schedule(name)
        loaders = [build_loader(run, split="valid", mode_schedule=schedule) for _ in model]
        reports = []
        for _ in range(run.train.eval_iters):
            reports += _forward_backward(run, model, loaders, forward_only=True)
        results[f"eval/loss_{name}"] = _loss_metrics(_loss_sums(reports), "eval")["eval/loss"]
    for chunk in model:
        chunk.train()
    return results


def _forward_backward(run: TrainConfig, model, loaders, forward_only: bool) -> List[dict]:
    t = run.train
    num_microbatches = t.global_batch_size // (t.micro_batch_size * parallel_state.get_data_parallel_world_size())
    iterators = loaders if len(loaders) > 1 else loaders[0]
    return get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators,
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=run.data.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=forward_only,
    )


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["modes"], labels=batch["labels"])
    return output, partial(_loss, batch["loss_mask"], batch["modes"])


def _loss(loss_mask, modes, per_token_loss):
    """Token-summed loss and token count (megatron divides by the global count), plus the
    sums over attention-mode tokens for per-mode logging."""
    mask = loss_mask.float()
    losses = per_token_loss.float() * mask
    attention = (modes == Mode.ATTENTION).float() * mask
    total, count = losses.sum(), mask.sum()
    report = torch.stack([total, count, (losses * attention).sum(), attention.sum()]).detach()
    return total, count.int(), {"loss_sums": report}


class Interval:
    """Loss sums, gradient norms and wall time of the steps since the last log line."""

    def __init__(self):
        self.start, self.loss_sums, self.grad_norms = time.perf_counter(), 0, []

    def add(self, loss_sums: torch.Tensor, grad_norm: float) -> None:
        self.loss_sums, self.grad_norms = self.loss_sums + loss_sums, self.grad_norms + [grad_norm]

    def seconds_per_step(self) -> float:
        return (time.perf_counter() - self.start) / len(self.grad_norms)

    def mean_grad_norm(self) -> float:
        return sum(self.grad_norms) / len(self.grad_norms)


def _loss_sums(reports: List[dict]) -> torch.Tensor:
    """[loss sum, tokens, attention-mode loss sum, attention-mode tokens] of the global batch
    (micro-batches summed, all-reduced over data-parallel ranks); zeros off the last stage."""
    sums = torch.zeros(4, dtype=torch.float64)
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


def _save(ckpt_dir, model, optimizer, scheduler, loader, run_yaml, iteration) -> None:
    if ckpt_dir:
        path = checkpointing.save_checkpoint(ckpt_dir, iteration, model, optimizer, scheduler, loader, run_yaml)
        logger.info("saved %s", path)


def _agree_on_paths(output_dir: str, ckpt_dir):
    """Rank 0's output and checkpoint paths for everyone (ranks may resolve `now` differently)."""
    paths = [output_dir, ckpt_dir]
    dist.broadcast_object_list(paths, src=0)
    return paths


def _total_params(local: int) -> int:
    """Parameters of the whole model: this rank's, summed over one data-parallel replica."""
    n = torch.tensor([local if parallel_state.get_data_parallel_rank() == 0 else 0], dtype=torch.float64)
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
    main()
