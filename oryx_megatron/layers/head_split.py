"""Per-head parameters, split with their heads over the tensor-parallel ranks."""

from typing import Callable, Dict, Optional, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor, nn

from oryx_megatron.config import OryxConfig


class HeadSplitModule(MegatronModule):
    """A module whose own parameters are per head: dim 0 splits over the TP ranks with the heads.

    Each is drawn at its full shape on the CPU generator and sliced, so that every TP size starts
    from the same weights, and is checkpointed as a shard of the full tensor along dim 0; child
    modules shard as they define.
    """

    def __init__(self, config: OryxConfig):
        super().__init__(config)
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.num_heads = config.num_attention_heads // self.tp_size  # heads on this rank
        self.head_params = []  # names of the parameters add_head_params made

    def add_head_params(self, specs: Dict[str, Tuple[Tuple[int, ...], Callable[..., Tensor]]],
                        dtype: Optional[torch.dtype] = None) -> None:
        """name -> (full shape, heads first; init drawing a full tensor of that shape): one
        parameter each, holding this rank's heads, in ``dtype`` (default: ``params_dtype``)."""
        device = None if self.config.use_cpu_initialization else torch.cuda.current_device()
        for name, (shape, init) in specs.items():
            local = (shape[0] // self.tp_size,) + shape[1:]
            param = nn.Parameter(torch.empty(local, dtype=dtype or self.config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            if self.config.perform_initialization:
                with torch.no_grad():
                    param.copy_(init(shape).chunk(self.tp_size, dim=0)[self.tp_rank])
            setattr(self, name, param)
            self.head_params.append(name)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Head-split parameters shard along dim 0; children shard as they define."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {name: getattr(self, name) for name in self.head_params}
        sharded = make_sharded_tensors_for_checkpoint(
            own, prefix, {name: 0 for name in own}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
        for name, module in self.named_children():
            sharded.update(
                sharded_state_dict_default(
                    module, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group
                )
            )
        return sharded
