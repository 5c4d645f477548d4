"""Per-head parameters, split with their heads over tensor-parallel ranks (plain torch: a front end says how)."""

import dataclasses
import math
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor, nn

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer.context_parallel import ContextParallel

Init = Callable[[Tuple[int, ...]], Tensor]  # full (TP=1) shape -> a tensor drawn on the CPU generator


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """This rank's share of the heads and how its parameters are made: tensor-parallel size and rank (the
    Hugging Face model: 1, 0), parameter dtype (None: torch's default dtype) and device, whether to draw initial
    values (False: a front end initialises or loads them), and the context-parallel group, over which a rank
    computes with a share of its heads (``HeadModule.local``)."""

    tp_size: int = 1
    tp_rank: int = 0
    dtype: Optional[torch.dtype] = None
    device: Optional[torch.device] = None
    initialize: bool = True
    cp: ContextParallel = dataclasses.field(default_factory=ContextParallel)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.dtype or torch.get_default_dtype()


class HeadModule(nn.Module):
    """A module whose own parameters are per head: dim 0 holds this rank's heads.

    Each is drawn at its full shape on the CPU generator and sliced (``initial_value``), so every TP size
    starts from the same weights; ``head_params`` names them (a megatron front end shards them along dim 0).
    """

    def __init__(self, config: MixerConfig, shard: HeadShard):
        super().__init__()
        if config.num_attention_heads % (shard.tp_size * shard.cp.size):
            raise ValueError(f"num_attention_heads={config.num_attention_heads} does not divide by tensor x context "
                             f"parallel size {shard.tp_size} x {shard.cp.size}: each rank mixes whole heads")
        self.config, self.shard = config, shard
        self.num_heads = config.num_attention_heads // shard.tp_size  # heads on this rank
        self.head_params: Dict[str, Tuple[Tuple[int, ...], Init]] = {}  # name -> (full shape, init)

    def add_head_params(self, specs: Dict[str, Tuple[Tuple[int, ...], Init]], dtype: Optional[torch.dtype] = None):
        """name -> (full shape, heads first; init): one parameter each, holding this rank's heads, in ``dtype``
        (default: the shard's)."""
        tp = self.shard.tp_size
        for name, (shape, init) in specs.items():
            local = (shape[0] // tp,) + tuple(shape[1:])
            param = nn.Parameter(torch.empty(local, dtype=dtype or self.shard.param_dtype, device=self.shard.device))
            self.register_parameter(name, param)
            self.head_params[name] = (tuple(shape), init)
            if self.shard.initialize:
                with torch.no_grad():
                    param.copy_(self.initial_value(name))

    def local(self, name: str) -> Tensor:
        """Head parameter ``name`` for the heads this rank mixes: all of them, or its context-parallel share (a
        slice: the gradient reaches the whole parameter)."""
        param, cp = getattr(self, name), self.shard.cp
        return param if cp.size == 1 else param.chunk(cp.size, dim=0)[cp.rank]

    def initial_value(self, name: str) -> Tensor:
        """This rank's slice of a fresh full draw of head parameter ``name``."""
        shape, init = self.head_params[name]
        return init(shape).chunk(self.shard.tp_size, dim=0)[self.shard.tp_rank]


class ShortConv(HeadModule):
    """The depthwise causal short conv of one stream: ``weight`` [h * width, kernel] (this rank's heads), the
    ``mixer_conv_kernel`` taps of each channel (nn.Conv1d's default initialisation)."""

    def __init__(self, config: MixerConfig, shard: HeadShard, width: int):
        super().__init__(config, shard)
        self.add_head_params({"weight": ((config.num_attention_heads * width, config.mixer_conv_kernel), self._init)})

    @staticmethod
    def _init(shape) -> Tensor:
        bound = 1.0 / math.sqrt(shape[1])  # nn.Conv1d's default for a depthwise conv
        return torch.empty(shape).uniform_(-bound, bound)


class GatedRMSNorm(HeadModule):
    """The shared per-head output norm and gate: RMSNorm over each head's d_v channels, times ``weight`` [h * d_v]
    and silu(gate) (``ops.gated_rms_norm``). Each head is normalised on its own, which brings both mixers to one
    scale before the shared W_O and keeps tensor parallelism (heads split over ranks) exact."""

    def __init__(self, config: MixerConfig, shard: HeadShard, kernels):
        super().__init__(config, shard)
        self.kernels = kernels
        self.add_head_params({"weight": ((config.num_attention_heads * config.value_head_dim,), torch.ones)})

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:
        """y, gate [b, s, h, d_v] -> [b, s, h, d_v]."""
        return self.kernels.gated_rms_norm(y, gate, self.local("weight"), self.config.layernorm_epsilon)
