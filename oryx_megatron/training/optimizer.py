"""megatron's optimizers over a bf16 model with fp32 parameters (the SSM scalars A_log, dt_bias, D).

megatron trains bf16 models whose parameters share one dtype (its Float16Module casts them all), and
its optimizer checkpoints rely on it (megatron-core 0.16.1 to 0.19.2):

- the mixed-precision optimizer (``Float16OptimizerWithFloat16Params``) numbers its torch parameters
  in model order, fp32 ones among the bf16 ones, but maps those numbers to model parameters by
  enumerating the bf16 parameters alone: the save fails ("Optimizer shape ... does not match model
  shape") or pairs state with the wrong parameter;
- the distributed optimizer lists each torch param group fp32 shards first, but indexes it in its
  grad buffers' order (bf16 buffer first): the save copies one parameter's state into another's place.

``align_param_order`` makes the orders agree, before the first step (no state exists yet); the
optimizers' steps do not depend on the order. A model of one dtype is left as it is.
"""

from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params


def align_param_order(optimizer) -> None:
    """Reorder the torch param groups of ``optimizer`` (or of each optimizer it chains) so that
    megatron's checkpoint mapping finds every parameter's state."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            _align_distributed(opt)
        elif isinstance(opt, Float16OptimizerWithFloat16Params):
            _align_float16(opt)


def _align_float16(opt: Float16OptimizerWithFloat16Params) -> None:
    """Per group: the fp32 copies of the bf16 parameters first, then the fp32 parameters; and the fp32
    parameters appended to ``float16_groups``, the model-side list megatron numbers the state by (its
    copy loops zip it with the fp32 copies, so they stop before the appended ones)."""
    for g, group in enumerate(opt.optimizer.param_groups):
        fp32 = opt.fp32_from_fp32_groups[g]
        if fp32 and opt.float16_groups[g]:
            group["params"] = [*opt.fp32_from_float16_groups[g], *fp32]
            opt.float16_groups[g] = [*opt.float16_groups[g], *fp32]


def _align_distributed(opt: DistributedOptimizer) -> None:
    """Per group: the shards in the order of ``opt_group_ranges`` (the grad buffers' order), which
    ``model_param_group_index_map`` indexes."""
    for g, group in enumerate(opt.optimizer.param_groups):
        if not (opt.model_fp32_groups[g] and opt.model_float16_groups[g]):
            continue
        listed = {id(p) for p in group["params"]}
        shard_of = {}  # model param -> the torch param the group holds for it
        pairs = ((opt.model_fp32_groups[g], opt.shard_fp32_groups[g]),
                 (opt.model_float16_groups[g], opt.shard_fp32_from_float16_groups[g]),  # main params
                 (opt.model_float16_groups[g], opt.shard_float16_groups[g]))  # precision-aware optimizer
        for models, shards in pairs:
            shard_of.update((m, s) for m, s in zip(models, shards) if id(s) in listed)
        group["params"] = [shard_of[m] for m in opt.opt_group_ranges[g]["params"]]
