"""The Oryx multi-mixer: causal softmax attention and a linear recurrent mixer
(Gated DeltaNet or Mamba-2, ``layers/linear_mixers``) sharing keys, values, output gate and
output projection.

Per token t and head h (design card, section 2):

    shared     k_t = act(conv_k(W_K x))_t     v_t = act(conv_v(W_V x))_t     g_t = W_G x_t
    attention  o_t = softmax-attention(rope(W_QA x_t), rope(k_{<=t}), v_{<=t})
    gdn        S_t = (I - b_t k_t k_t^T) exp(a_t) S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
               (q, k L2-normalised; q_t = act(conv_q(W_QL x))_t)
    mamba2     S_t = exp(A dt_t) S_{t-1} + dt_t k_t v_t^T,                 o_t = S_t^T q_t + D v_t
    output     out_t = W_O( RMSNorm_per_head(o_t of the token's mode) * silu(g_t) )

With ``shared_query`` (ablation A1) attention reads with the linear query q_t instead of
W_QA x_t, so the two mixers share their query as they share the key.

Both memories (KV cache and recurrent state) absorb every token whatever its mode;
``modes`` [b, s] only chooses which one each token reads.

Tensor parallelism splits heads: the fused input projection ``in_proj`` is laid out head-major
(per head: k, v, g, then the mixer-specific queries and scalars), so a plain
column-parallel split hands each rank whole heads and a checkpoint reshards along
dim 0 like any column-parallel weight. Convs, A_log, dt_bias, D and the norm weight
are split with their heads; W_O (``out_proj``) is row-parallel.
"""

import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor

from oryx_megatron.config import Mode, OryxConfig
from oryx_megatron.layers.head_split import HeadSplitModule
from oryx_megatron.layers.linear_mixers import LINEAR_MIXER_CLASSES
from oryx_megatron.layers.norms import gated_head_rms_norm, upcast
from oryx_megatron.ops import apply_rotary, get_kernels, rotary_cos_sin

logger = logging.getLogger(__name__)


@dataclass
class MultiMixerSubmodules:
    in_proj: Union[ModuleSpec, type]  # column-parallel fused input projection
    core_attention: Union[ModuleSpec, type]  # q, k, v -> o (bottom-right causal)
    out_proj: Union[ModuleSpec, type]  # row-parallel W_O


@dataclass
class MixerCache:
    """Inference state of one layer, updated on every token whatever its mode."""

    conv_states: Dict[str, Tensor]  # stream -> [b, channels, conv_kernel - 1]
    key: Tensor  # [b, t, h, d_k], rotated (empty for a linear-only layer)
    value: Tensor  # [b, t, h, d_v]
    recurrent_state: Optional[Tensor]  # [b, h, d_k, d_v] fp32, None for attention-only
    seqlen: int = 0

    def nbytes(self) -> Dict[str, int]:
        kv = self.key.nbytes + self.value.nbytes
        rec = self.recurrent_state.nbytes if self.recurrent_state is not None else 0
        return {"kv": kv, "recurrent": rec, "conv": sum(t.nbytes for t in self.conv_states.values())}


class MultiMixer(HeadSplitModule):
    """Shared-K/V sequence mixer; input and output hidden states are [s, b, hidden]."""

    def __init__(
        self, config: OryxConfig, submodules: MultiMixerSubmodules, layer_number: int = 1
    ):
        super().__init__(config)
        self.layer_number = layer_number
        self.kernels = get_kernels(config.kernel_backend)
        if layer_number == 1:
            logger.info("MultiMixer kernels (%s): %s", config.kernel_backend, self.kernels.names)
        self.has_attention = config.has_attention
        linear_mixer = LINEAR_MIXER_CLASSES.get(config.linear_mixer)  # None: attention only
        self.d_k, self.d_v = config.kv_channels, config.value_head_dim

        # Per-head widths of the fused input projection, in layout order, and the convolved ones.
        self.streams = {"k": self.d_k, "v": self.d_v, "g": self.d_v}
        self.conv_streams = ["k", "v"]
        if self.has_attention and not config.shared_query:
            self.streams["q_attn"] = self.d_k
        if linear_mixer is not None:
            self.streams.update(linear_mixer.streams(config))
            self.conv_streams += linear_mixer.conv_streams
        if "q_attn" in self.streams and config.attention_query_conv:
            self.conv_streams.append("q_attn")
        self.attention_query = "q_lin" if config.shared_query else "q_attn"  # stream attention reads with

        heads = config.num_attention_heads
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            heads * sum(self.streams.values()),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=self.tp_group,
        )
        if self.has_attention:
            self.core_attention = build_module(
                submodules.core_attention, config=config, layer_number=layer_number
            )
        self.out_proj = build_module(
            submodules.out_proj,
            heads * self.d_v,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=self.tp_group,
        )
        # Shared per-head parameters, split with their heads (the linear mixer's come last).
        specs = {
            f"conv_{name}": ((heads * self.streams[name], config.mixer_conv_kernel), self._init_conv)
            for name in self.conv_streams
        }
        specs["out_norm_weight"] = ((heads * self.d_v,), torch.ones)
        self.add_head_params(specs)
        self.linear_mixer = None if linear_mixer is None else linear_mixer(config, self.kernels)

    def _init_conv(self, shape):
        """Full (TP=1) conv weight, drawn on the CPU generator."""
        bound = 1.0 / math.sqrt(shape[1])  # nn.Conv1d default for a depthwise conv
        return torch.empty(shape).uniform_(-bound, bound)

    # ---- the parallel forward (training, prefill) ----
    def forward(
        self,
        hidden_states: Tensor,
        modes: Optional[Tensor] = None,
        inference_cache: Optional[MixerCache] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """hidden_states [s, b, hidden] (sequence-sharded under SP), modes [b, s] -> (out, bias).

        With ``inference_cache`` the sequence continues the cached one (prefill); one
        token with a cache is a decode step (``step``).
        """
        if inference_cache is not None and inference_cache.seqlen > 0 and hidden_states.shape[0] == 1:
            return self.step(hidden_states, modes, inference_cache)
        x = self._project(hidden_states)  # stream -> [b, s, h, d]
        cache = inference_cache
        for name in self.conv_streams:  # shared short convs (and the linear query's)
            state = cache.conv_states[name] if cache is not None else None
            x[name], state = self._conv(x[name], getattr(self, f"conv_{name}"), state)
            if cache is not None:
                cache.conv_states[name] = state

        outputs = {}
        if self.has_attention:
            outputs[Mode.ATTENTION] = self._attend(x[self.attention_query], x["k"], x["v"], cache)
        if self.linear_mixer is not None:
            initial = cache.recurrent_state if cache is not None else None
            o, state = self.linear_mixer(x, initial, output_final_state=cache is not None)
            outputs[Mode.LINEAR] = o  # [b, s, h, d_v]
            if cache is not None:
                cache.recurrent_state = state
        if cache is not None:
            cache.seqlen += x["k"].shape[1]
        return self._output(self._select(outputs, modes), x["g"])

    # ---- one-token decode ----
    def step(
        self, hidden_states: Tensor, modes: Optional[Tensor], inference_cache: MixerCache
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Decode one token: hidden_states [1, b, hidden], modes [b, 1] or [b]."""
        cache = inference_cache
        x = {name: t.squeeze(1) for name, t in self._project(hidden_states).items()}  # [b, h, d]
        for name in self.conv_streams:
            b, h, d = x[name].shape
            y, cache.conv_states[name] = self.kernels.causal_conv1d_step(
                x[name].reshape(b, h * d), cache.conv_states[name], getattr(self, f"conv_{name}"),
                activation=self.config.mixer_conv_activation,
            )
            x[name] = y.view(b, h, d)

        outputs = {}
        if self.has_attention:
            o = self._attend(x[self.attention_query][:, None], x["k"][:, None], x["v"][:, None], cache)
            outputs[Mode.ATTENTION] = o[:, 0]
        if self.linear_mixer is not None:
            outputs[Mode.LINEAR], cache.recurrent_state = self.linear_mixer.step(x, cache.recurrent_state)
        cache.seqlen += 1
        modes = None if modes is None else modes.reshape(-1, 1)
        y = self._select({m: o[:, None] for m, o in outputs.items()}, modes)
        return self._output(y, x["g"][:, None])

    def allocate_inference_cache(self, batch_size: int, dtype: torch.dtype, device=None) -> MixerCache:
        """An empty cache: zero conv and recurrent states, no keys yet."""
        h, w = self.num_heads, self.config.mixer_conv_kernel
        conv_states = {
            name: torch.zeros(batch_size, h * self.streams[name], w - 1, dtype=dtype, device=device)
            for name in self.conv_streams
        }
        kv_heads = h if self.has_attention else 0
        key = torch.zeros(batch_size, 0, kv_heads, self.d_k, dtype=dtype, device=device)
        value = torch.zeros(batch_size, 0, kv_heads, self.d_v, dtype=dtype, device=device)
        recurrent = None
        if self.linear_mixer is not None:
            state_dtype = torch.promote_types(dtype, torch.float32)
            recurrent = torch.zeros(self.linear_mixer.state_shape(batch_size), dtype=state_dtype, device=device)
        return MixerCache(conv_states, key, value, recurrent)

    # ---- pieces shared by forward and step ----
    def _project(self, hidden_states: Tensor) -> Dict[str, Tensor]:
        """[s, b, hidden] -> stream -> [b, s, h, width] (all-gathered sequence under SP)."""
        proj, _ = self.in_proj(hidden_states)  # [s, b, h * sum(widths)]
        s, b = proj.shape[:2]
        proj = proj.transpose(0, 1).reshape(b, s, self.num_heads, -1)
        return dict(zip(self.streams, proj.split(list(self.streams.values()), dim=-1)))

    def _conv(self, x: Tensor, weight: Tensor, state: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        b, s, h, d = x.shape
        y, final_state = self.kernels.causal_conv1d(
            x.reshape(b, s, h * d), weight, initial_state=state,
            activation=self.config.mixer_conv_activation,
        )
        return y.view(b, s, h, d), final_state

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Optional[MixerCache]) -> Tensor:
        """Causal softmax read over all earlier tokens (cached ones included): [b, s, h, d_v]."""
        if self.config.attention_rotary:
            offset = cache.seqlen if cache is not None else 0
            positions = torch.arange(offset, offset + q.shape[1], device=q.device)
            cos, sin = rotary_cos_sin(positions, self.d_k, self.config.rotary_base, dtype=upcast(q).dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            cache.key = k = torch.cat([cache.key, k], dim=1)
            cache.value = v = torch.cat([cache.value, v], dim=1)
        return self.core_attention(q, k, v)

    def _select(self, outputs: Dict[Mode, Tensor], modes: Optional[Tensor]) -> Tensor:
        """Each token reads with its mode's mixer: [b, s, h, d_v]."""
        if len(outputs) == 1:
            return next(iter(outputs.values()))
        if modes is None:
            raise ValueError(f"modes [batch, seq] is required by a multi-mixer layer (mixers={self.config.mixers})")
        attention = (modes == Mode.ATTENTION)[:, :, None, None]
        return torch.where(attention, outputs[Mode.ATTENTION], outputs[Mode.LINEAR])

    def _output(self, y: Tensor, gate: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Shared per-head norm, output gate and W_O: [b, s, h, d_v] -> [s, b, hidden]."""
        y = gated_head_rms_norm(y, gate, self.out_norm_weight, self.config.layernorm_epsilon)
        b, s = y.shape[:2]
        return self.out_proj(y.reshape(b, s, -1).transpose(0, 1).contiguous())

    # ---- accounting ----
    def parameter_counts(self) -> Dict[str, int]:
        """Parameters (this rank) by use: 'shared' by every mixer, or specific to one mode: the
        input-projection rows (and conv) of a stream only that mode reads, and for linear mode
        the linear mixer's own parameters."""
        total = sum(p.numel() for p in self.parameters())
        if not self.config.is_multi_mixer:
            return {"shared": total, "attention": 0, "linear": 0}
        attention, linear = {self.attention_query}, set(self.linear_mixer.streams(self.config))
        specific = {"attention": 0, "linear": sum(p.numel() for p in self.linear_mixer.parameters())}
        for mode, only in (("attention", attention - linear), ("linear", linear - attention)):
            for name in only:
                specific[mode] += self.num_heads * self.streams[name] * self.config.hidden_size
                if name in self.conv_streams:
                    specific[mode] += getattr(self, f"conv_{name}").numel()
        return {"shared": total - sum(specific.values()), **specific}
