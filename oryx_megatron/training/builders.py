"""Everything a run builds from its config: model chunks, optimizer, LR schedule, loaders."""

from typing import List

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from oryx_megatron.data.indexed import IndexedLoader
from oryx_megatron.data.loader import ShardLoader
from oryx_megatron.data.synthetic import MQARLoader
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.run_config import TrainConfig, train_iters
from oryx_megatron.training.optimizer import align_param_order


def model_config(run: TrainConfig):
    """The megatron TransformerConfig of the run: the recipe plus parallelism and precision."""
    p, t = run.parallel, run.train
    dtype = torch.bfloat16 if t.bf16 else torch.float32
    fields = dict(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context_parallel_size,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        calculate_per_token_loss=True,  # the loss is a mean over all tokens of the global batch
    )
    if p.virtual_pipeline_model_parallel_size is not None:
        # megatron's batched p2p (the default) posts a step's sends and receives in one order on every
        # rank; at PP=2 the previous and next stage are one rank, so the interleaved schedule's two
        # messages to it (activation, gradient) cross: the next stage computes on the gradient. The
        # separate, overlapped exchange that Megatron-LM uses with interleaving pairs them.
        fields.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    if t.recompute_granularity == "full":  # every layer's forward again in the backward
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif t.recompute_granularity == "selective":  # the mixing between the projections (MultiMixer)
        fields.update(recompute_granularity="selective")
    return transformer_config(run.model, run.router, **fields)


def build_model_chunks(run: TrainConfig, config, device: torch.device) -> List[DistributedDataParallel]:
    """This rank's model chunks (one, or one per virtual pipeline stage), each built (on the CPU
    generator: the same weights at any layout), moved to ``device``, then wrapped in megatron DDP."""
    vp_size = run.parallel.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vp_size):
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        chunk = build_model(run.model, config, pre_process=pre, post_process=post, vp_stage=vp_stage)
        chunks.append(chunk.to(device))
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=run.parallel.overlap_grad_reduce,
        use_distributed_optimizer=run.optimizer.use_distributed_optimizer,
    )
    model = [
        DistributedDataParallel(config, ddp_config, chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    config.finalize_model_grads_func = finalize_model_grads
    if run.parallel.overlap_grad_reduce:
        no_sync = [chunk.no_sync for chunk in model]
        config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return model


def build_optimizer(run: TrainConfig, model):
    o = run.optimizer
    config = MegatronOptimizerConfig(
        optimizer=o.optimizer,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=run.train.bf16,
        params_dtype=torch.bfloat16 if run.train.bf16 else torch.float32,
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, model)
    align_param_order(optimizer)  # the fp32 SSM scalars of a bf16 model (training/optimizer.py)
    return optimizer


def build_scheduler(run: TrainConfig, optimizer) -> OptimizerParamScheduler:
    """Warmup, then cosine / linear / constant decay to min_lr, or WSD; steps are iterations."""
    o, iters = run.optimizer, train_iters(run)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=min(o.lr_warmup_iters, iters - 1),
        lr_decay_steps=iters,
        lr_decay_style=o.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=iters,
        wd_incr_style="constant",
        wsd_decay_steps=o.lr_wsd_decay_iters,
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )


def build_loader(run: TrainConfig, split: str = "train", mode_schedule=None):
    """The loader of this data-parallel rank ("train", or the held-out "valid" split; for mqar
    a separate seed stream)."""
    d, t = run.data, run.train
    common = dict(
        seq_len=d.seq_length,
        micro_batch_size=t.micro_batch_size,
        seed=t.seed,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        num_workers=d.num_workers,
        mode_schedule=mode_schedule or d.mode_schedule,
        reset_at_eod=d.reset_at_eod,
    )
    if d.format == "mqar":
        common.pop("num_workers")
        return MQARLoader(vocab_size=d.mqar_vocab_size or run.model.vocab_size, num_pairs=d.mqar_num_pairs,
                          num_queries=d.mqar_num_queries, filler_id=d.mqar_filler_id, query_spans=d.mqar_query_spans,
                          context_segments=d.mqar_context_segments, split=split, **common)
    if d.format == "indexed":
        iters = train_iters(run) if split == "train" else t.eval_iters
        return IndexedLoader(d.data_path, num_samples=iters * t.global_batch_size, eod_id=d.eod_id,
                             split=split, split_ratio=d.split, **common)
    return ShardLoader(d.data_path, holdout_shards=d.holdout_shards, split=split,
                       holdout_tail=t.eval_interval is not None, **common)
