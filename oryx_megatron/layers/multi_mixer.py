"""The Oryx multi-mixer: causal softmax attention and a linear recurrent mixer
(Gated DeltaNet or Mamba-2) sharing keys, values, output gate and output projection.

Per token t and head h (design card, section 2):

    shared     k_t = act(conv_k(W_K x))_t     v_t = act(conv_v(W_V x))_t     g_t = W_G x_t
    attention  o_t = softmax-attention(rope(W_QA x_t), rope(k_{<=t}), v_{<=t})
    gdn        S_t = exp(a_t) S_{t-1} (I - b_t k_t k_t^T) + b_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
               (q, k L2-normalised; q_t = act(conv_q(W_QL x))_t)
    mamba2     S_t = exp(A dt_t) S_{t-1} + dt_t k_t v_t^T,                 o_t = S_t^T q_t + D v_t
    output     out_t = W_O( RMSNorm_per_head(o_t of the token's mode) * silu(g_t) )

With ``shared_query`` (ablation A1) attention reads with the linear query q_t instead of
W_QA x_t, so the two mixers share their query as they share the key.

Both memories (KV cache and recurrent state) absorb every token whatever its mode;
``modes`` [b, s] only chooses which one each token reads.

Tensor parallelism splits heads: the fused input projection is laid out head-major
(per head: k, v, g, then the mixer-specific queries and scalars), so a plain
column-parallel split hands each rank whole heads and a checkpoint reshards along
dim 0 like any column-parallel weight. Convs, A_log, dt_bias, D and the norm weight
are split with their heads; W_O is row-parallel.
"""

import logging
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor, nn

from oryx_megatron.config import OryxConfig
from oryx_megatron.data.modes import Mode
from oryx_megatron.layers.norms import gated_head_rms_norm, upcast
from oryx_megatron.ops import apply_rotary, get_kernels, rotary_cos_sin

logger = logging.getLogger(__name__)


@dataclass
class MultiMixerSubmodules:
    linear_in: Union[ModuleSpec, type]  # column-parallel fused input projection
    core_attention: Union[ModuleSpec, type]  # q, k, v -> o (bottom-right causal)
    linear_out: Union[ModuleSpec, type]  # row-parallel W_O


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


class MultiMixer(MegatronModule):
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
        self.linear_mixer = config.linear_mixer
        self.tp_group = tp_group = parallel_state.get_tensor_model_parallel_group()
        self.tp_size, self.tp_rank = tp_group.size(), tp_group.rank()
        self.num_heads = config.num_attention_heads // self.tp_size  # heads on this rank
        self.d_k, self.d_v = config.kv_channels, config.value_head_dim

        # Per-head widths of the fused input projection, in layout order.
        self.streams = {"k": self.d_k, "v": self.d_v, "g": self.d_v}
        if self.has_attention and not config.shared_query:
            self.streams["q_attn"] = self.d_k
        if self.linear_mixer == "gdn":
            self.streams.update(q_lin=self.d_k, beta=1, alpha=1)
        elif self.linear_mixer == "mamba2":
            self.streams.update(q_lin=self.d_k, dt=1)
        self.conv_streams = ["k", "v"] + [
            name
            for name in ("q_lin", "q_attn")
            if name in self.streams and (name == "q_lin" or config.attention_query_conv)
        ]
        self.attention_query = "q_lin" if config.shared_query else "q_attn"  # stream attention reads with

        heads = config.num_attention_heads
        self.linear_in = build_module(
            submodules.linear_in,
            config.hidden_size,
            heads * sum(self.streams.values()),
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="qkv",
            tp_group=tp_group,
        )
        if self.has_attention:
            self.core_attention = build_module(
                submodules.core_attention, config=config, layer_number=layer_number
            )
        self.linear_out = build_module(
            submodules.linear_out,
            heads * self.d_v,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="proj",
            tp_group=tp_group,
        )

        # Small per-head parameters, split with their heads: name -> (full shape, init).
        w = config.mixer_conv_kernel
        specs = {
            f"conv_{name}": ((heads * self.streams[name], w), self._init_conv)
            for name in self.conv_streams
        }
        specs["out_norm_weight"] = ((heads * self.d_v,), torch.ones)
        if self.linear_mixer is not None:
            specs["A_log"] = ((heads,), self._init_A_log)
            specs["dt_bias"] = ((heads,), self._init_dt_bias)
        if self.linear_mixer == "mamba2":
            specs["D"] = ((heads,), torch.ones)
        self.head_params = list(specs)
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        for name, (shape, init) in specs.items():
            local = (shape[0] // self.tp_size,) + shape[1:]
            param = nn.Parameter(torch.empty(local, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
            if config.perform_initialization:
                # Draw the full tensor and keep this rank's heads: same weights at any TP size.
                with torch.no_grad():
                    param.copy_(init(shape).chunk(self.tp_size, dim=0)[self.tp_rank])
            setattr(self, name, param)

    # ---- initialisation (full, TP=1 shapes; drawn on the CPU generator) ----
    def _init_conv(self, shape):
        bound = 1.0 / math.sqrt(shape[1])  # nn.Conv1d default for a depthwise conv
        return torch.empty(shape).uniform_(-bound, bound)

    def _init_A_log(self, shape):
        return torch.empty(shape).uniform_(*self.config.A_init_range).log()

    def _init_dt_bias(self, shape):
        c = self.config
        log_dt = torch.rand(shape) * (math.log(c.dt_max) - math.log(c.dt_min)) + math.log(c.dt_min)
        dt = log_dt.exp().clamp(min=c.dt_init_floor)
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus

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
            q, k, v = self._linear_qk(x["q_lin"], x["k"]) + (x["v"],)
            decay, rate = self._decay_and_rate(x)  # [b, s, h] each, fp32
            initial = cache.recurrent_state if cache is not None else None
            if self.linear_mixer == "gdn":
                o, state = self.kernels.chunk_gated_delta_rule(
                    q, k, v, decay, rate, initial_state=initial,
                    output_final_state=cache is not None, chunk_size=self.config.linear_chunk_size,
                )
            else:
                o, state = self.kernels.ssd_chunk_scan(
                    v, rate, -torch.exp(upcast(self.A_log)), k, q, D=self.D, initial_state=initial,
                    output_final_state=cache is not None, chunk_size=self.config.linear_chunk_size,
                )
            outputs[Mode.LINEAR] = o
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
            q, k = self._linear_qk(x["q_lin"], x["k"])
            decay, rate = self._decay_and_rate(x)  # [b, h]
            if self.linear_mixer == "gdn":
                o, cache.recurrent_state = self.kernels.gated_delta_rule_step(
                    q, k, x["v"], decay, rate, cache.recurrent_state
                )
            else:
                o, cache.recurrent_state = self.kernels.ssd_step(
                    x["v"], rate, -torch.exp(upcast(self.A_log)), k, q, cache.recurrent_state, D=self.D
                )
            outputs[Mode.LINEAR] = o
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
            recurrent = torch.zeros(batch_size, h, self.d_k, self.d_v, dtype=state_dtype, device=device)
        return MixerCache(conv_states, key, value, recurrent)

    # ---- pieces shared by forward and step ----
    def _project(self, hidden_states: Tensor) -> Dict[str, Tensor]:
        """[s, b, hidden] -> stream -> [b, s, h, width] (all-gathered sequence under SP)."""
        proj, _ = self.linear_in(hidden_states)  # [s, b, h * sum(widths)]
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

    def _linear_qk(self, q: Tensor, k: Tensor) -> Tuple[Tensor, Tensor]:
        """GDN reads with L2-normalised query and key; Mamba-2 uses them as C and B."""
        if self.linear_mixer == "gdn":
            return F.normalize(q, p=2, dim=-1, eps=1e-6), F.normalize(k, p=2, dim=-1, eps=1e-6)
        return q, k

    def _decay_and_rate(self, x: Dict[str, Tensor]) -> Tuple[Optional[Tensor], Tensor]:
        """GDN: (log decay a, beta); Mamba-2: (None, dt). fp32 (or wider), per head."""
        dt_bias = upcast(self.dt_bias)
        if self.linear_mixer == "gdn":
            a = -torch.exp(upcast(self.A_log)) * F.softplus(upcast(x["alpha"][..., 0]) + dt_bias)
            return a, torch.sigmoid(upcast(x["beta"][..., 0]))
        return None, F.softplus(upcast(x["dt"][..., 0]) + dt_bias)

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
        return self.linear_out(y.reshape(b, s, -1).transpose(0, 1).contiguous())

    # ---- accounting and checkpoints ----
    def parameter_counts(self) -> Dict[str, int]:
        """Parameters (this rank) by use: 'shared' by every mixer, or specific to one mode."""
        hidden = self.config.hidden_size
        rows = {name: self.num_heads * width for name, width in self.streams.items()}
        own = {name: getattr(self, name).numel() for name in self.head_params}
        specific = {"attention": rows.get("q_attn", 0) * hidden, "linear": 0}
        linear_query = () if self.config.shared_query else ("q_lin",)  # a shared query is shared
        for name in linear_query + ("beta", "alpha", "dt"):
            specific["linear"] += rows.get(name, 0) * hidden
        for name in tuple(f"conv_{q}" for q in linear_query) + ("A_log", "dt_bias", "D"):
            specific["linear"] += own.get(name, 0)
        specific["attention"] += own.get("conv_q_attn", 0)
        total = sum(p.numel() for p in self.parameters())
        if not self.config.is_multi_mixer:
            return {"shared": total, "attention": 0, "linear": 0}
        return {"shared": total - sum(specific.values()), **specific}

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
