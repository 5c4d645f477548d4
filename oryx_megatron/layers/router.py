"""The chunk router (``oryx_megatron.mixer.ChunkRouter``) as a megatron model part: the features [b, n, h,
layers, 2, d_v] are split with their heads over the tensor-parallel ranks, so W1 is row-parallel (an
all-reduce of [n, b, hidden])."""

import dataclasses

from megatron.core.tensor_parallel import RowParallelLinear
from torch import Tensor

from oryx_megatron.layers.config import OryxConfig
from oryx_megatron.mixer import ChunkRouter
from oryx_megatron.mixer.router import router_features


class ParallelChunkRouter(ChunkRouter):
    """features [b, n, h_local, layers, 2, d_v] -> logits [b, n]; its architecture is ``config.router``'s."""

    def __init__(self, config: OryxConfig):
        fc1 = RowParallelLinear(
            router_features(config, config.router.layers), config.router.hidden,
            config=dataclasses.replace(config, sequence_parallel=False),  # chunks, not tokens
            init_method=config.init_method, bias=True, input_is_parallel=True, skip_bias_add=False,
        )
        super().__init__(config, config.router, config.params_dtype, fc1)

    def _hidden(self, features: Tensor) -> Tensor:
        h, _ = self.fc1(features.transpose(0, 1))  # [n, b, hidden]
        return h.transpose(0, 1)
