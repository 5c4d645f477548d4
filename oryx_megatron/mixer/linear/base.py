"""The interface of a linear recurrent mixer of the Oryx block (Gated DeltaNet, Mamba-2, ...)."""

import math
from abc import ABC, abstractmethod
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from oryx_megatron.config import MixerConfig
from oryx_megatron.mixer.heads import HeadModule, HeadShard
from oryx_megatron.mixer.state import State
from oryx_megatron.ops import Documents, Kernels, upcast


class LinearMixer(HeadModule, ABC):
    """A recurrent memory over the block's shared keys and values, read with its own query.

    The Oryx mixer (``OryxMixer``) hands it every stream of the fused input projection, per head: the shared
    ``k`` [.., h, d_k] and ``v`` [.., h, d_v] (after their short convs) and the mixer's own
    streams, whose widths ``streams`` declares. The mixer owns its small per-head parameters
    (``add_scalar_params``, kept in fp32; ``add_decay_params`` for A_log and dt_bias), turns its
    streams into per-token scalars in fp32, and runs its chunked scan (``forward``) or one token
    (``step``) with the kernels of ``oryx_megatron.ops``. A new linear mixer is one subclass and one entry
    in ``oryx_megatron.mixer.linear.LINEAR_MIXERS`` (docs/model.md, "Adding a linear mixer").

    Parameter accounting: its streams' rows of the input projection (and their convs) and all
    of its parameters are specific to linear mode, except a query shared with attention.
    """

    conv_streams: Tuple[str, ...] = ("q_lin",)  # its streams that get a short conv, as k and v do

    @staticmethod
    def hidden_projections(config: MixerConfig) -> Dict[str, int]:
        """Its features of the hidden state that every head reads, name -> width (e.g. a low-rank gate's first
        stage, hidden -> 16, as fla's GLA): the front ends build one projection for them (``hidden_proj``, the
        same on every tensor-parallel rank) and hand them in ``x`` as [.., width], not split by heads; its
        per-head second stage is its own head parameter. None by default."""
        return {}

    def __init__(self, config: MixerConfig, shard: HeadShard, kernels: Kernels):
        super().__init__(config, shard)
        self.kernels = kernels
        self.d_k, self.d_v = config.kv_channels, config.value_head_dim

    @staticmethod
    @abstractmethod
    def streams(config: MixerConfig) -> Dict[str, int]:
        """Per-head widths of its rows of the fused input projection, in layout order."""

    @abstractmethod
    def forward(
        self, x: Dict[str, Tensor], initial_state: Optional[State] = None, output_final_state: bool = False,
        documents: Optional[Documents] = None,
    ) -> Tuple[Tensor, Optional[State]]:
        """Chunked scan of a sequence: stream -> [b, s, h, width] -> (o [b, s, h, d_v], the final
        state (name -> tensor, as ``state_spec`` declares), or None unless output_final_state); initial_state: such
        a state, or None (zeros); documents (packed documents) or None: the state restarts from zero at each document
        start."""

    @abstractmethod
    def step(self, x: Dict[str, Tensor], state: State) -> Tuple[Tensor, State]:
        """One token: stream -> [b, h, width] and the state -> (o [b, h, d_v], the new state)."""

    def state_spec(self, batch_size: int, dtype: torch.dtype) -> Dict[str, Tuple[Tuple[int, ...], torch.dtype]]:
        """Its recurrent state, name -> (shape, dtype), for activations of ``dtype``: every shape [b, h, ...] (b
        sequences, this rank's h heads: a document start zeroes a row, tensor parallelism splits the heads). The
        core allocates each tensor (zeros), hands the state to ``forward`` and ``step`` and copies what they
        return in place; snapshots, document resets, byte counts and vLLM's slots go tensor by tensor. Default:
        one matrix memory S [b, h, d_k, d_v] in fp32 (or wider)."""
        return {"S": ((batch_size, self.num_heads, self.d_k, self.d_v), torch.promote_types(dtype, torch.float32))}

    # ---- decay: A_log and dt_bias, and the per-token scalars they give, fp32 (or wider) ----
    def add_scalar_params(self, specs) -> None:
        """Per-head scalars of the recurrence (A_log, dt_bias, D) as ``add_head_params`` makes them, but
        kept in fp32 (or wider) under any parameter dtype: in bf16 they would lose all but 8 bits of
        the decay rates (mamba-ssm and megatron's Mamba mixer keep them in fp32; mamba issues 6, 352)."""
        self.add_head_params(specs, dtype=torch.promote_types(self.shard.param_dtype, torch.float32))

    def add_decay_params(self) -> None:
        """A_log and dt_bias, one per head (Mamba-2's initialisation)."""
        heads = self.config.num_attention_heads
        self.add_scalar_params({"A_log": ((heads,), self._init_A_log), "dt_bias": ((heads,), self._init_dt_bias)})

    @property
    def A(self) -> Tensor:
        """A = -exp(A_log) [h], the per-head decay rate."""
        return -torch.exp(upcast(self.local("A_log")))

    def time_step(self, raw: Tensor) -> Tensor:
        """softplus(raw + dt_bias): a width-1 stream [.., h, 1] -> [.., h]."""
        return F.softplus(upcast(raw[..., 0]) + upcast(self.local("dt_bias")))

    # full (TP=1) shapes, drawn on the CPU generator
    def _init_A_log(self, shape):
        return torch.empty(shape).uniform_(*self.config.A_init_range).log()

    def _init_dt_bias(self, shape):
        c = self.config
        log_dt = torch.rand(shape) * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min)
        dt = log_dt.exp().clamp(min=c.dt_init_floor)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
