"""``OryxMixer``: the Oryx sequence mixer as plain torch modules, its math from ``oryx_megatron.ops``.

Per token t and head (docs/model.md, "One layer"):

    shared     k_t = act(conv_k(W_K x))_t [* gate(W_KG x_t)],  v_t likewise,  g_t = W_G x_t
    attention  o_t = softmax-attention(rope(q_attn_t), rope(k_{<=t}), v_{<=t}),  q_attn_t = W_QA x_t (or the
               linear query with ``shared_query``; conv'd with ``attention_query_conv``)
    linear     the linear mixer's read of its recurrent state (``linear_mixers``)
    output     W_O( RMSNorm_per_head(o_t of the token's mode) * silu(g_t) )

Both memories absorb every token; each token reads the mixer its mode names, and only what some token
reads is computed (attention over the 128-position query blocks that hold a reader). All streams come from
one head-major projection ``in_proj`` (``layout.mixer_streams``); hidden states are [b, s, hidden].
"""

import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from transformers import initialization as init

from oryx_megatron.config import Mode
from oryx_megatron.hf.cache import OryxCache, OryxLayerCache
from oryx_megatron.hf.layout import conv_streams, mixer_streams
from oryx_megatron.hf.linear_mixers import LINEAR_MIXERS
from oryx_megatron.ops import apply_rotary, decode_attention, get_kernels, kv_gate, rotary_table, upcast

QUERY_BLOCK = 128  # query positions per block of the block-sparse attention read (megatron's SDPAttention)


@dataclass(frozen=True)
class Reads:
    """What the tokens of one forward read, decided once for every layer: ``modes``, one Mode for every
    token or [b, s] per token; ``read``, the modes some token reads; ``attention_readers`` [b, s] bool
    where the tokens' modes differ (None: every token reads one mode)."""

    modes: Union[Mode, Tensor]
    read: FrozenSet[Mode]
    attention_readers: Optional[Tensor] = None


class ShortConv(nn.Module):
    """Depthwise causal conv over ``channels`` (weight [channels, width], megatron's layout)."""

    def __init__(self, channels: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, width))

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1])  # nn.Conv1d's default for a depthwise conv
        init.uniform_(self.weight, -bound, bound)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's channels, times the weight [h * d] and silu(gate): ``ops.gated_rms_norm``."""

    def __init__(self, size: int, eps: float, kernels):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps, self.kernels = eps, kernels

    def forward(self, y: Tensor, gate: Tensor) -> Tensor:  # [b, s, h, d] twice
        return self.kernels.gated_rms_norm(y, gate, self.weight, self.eps)


class OryxMixer(nn.Module):
    """The mixer of layer ``layer_idx`` (its state in an ``OryxCache``): [b, s, hidden] in and out."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.kernels = get_kernels(config.kernel_backend)
        self.streams, self.conv_streams = mixer_streams(config), conv_streams(config)
        self.heads, self.has_attention = config.num_attention_heads, config.has_attention
        self.attention_query = "q_lin" if config.shared_query else "q_attn"
        self.in_proj = nn.Linear(config.hidden_size, self.heads * sum(self.streams.values()), bias=False)
        for name in self.conv_streams:
            self.add_module(f"conv_{name}", ShortConv(self.heads * self.streams[name], config.conv_kernel))
        self.linear_mixer = LINEAR_MIXERS[config.linear_mixer](config, self.kernels)
        self.out_norm = GatedRMSNorm(self.heads * config.value_head_dim, config.rms_norm_eps, self.kernels)
        self.out_proj = nn.Linear(self.heads * config.value_head_dim, config.hidden_size, bias=False)

    def forward(self, hidden: Tensor, reads: Reads, cache: Optional[OryxCache] = None,
                document_ids: Optional[Tensor] = None) -> Tensor:
        """hidden [b, s, hidden] -> [b, s, hidden]. With ``cache`` the tokens continue the cached ones (one
        token: a decode step); ``document_ids`` [b, s]: packed documents, each read as if alone."""
        state = None if cache is None else cache.layers[self.layer_idx]
        if cache is not None and cache.seqlen > 0 and hidden.shape[1] == 1:
            return self._step(hidden, reads, cache, state)
        offset = 0 if cache is None else cache.seqlen
        x = self._project(hidden)  # stream -> [b, s, h, width]
        for name in self.conv_streams:
            initial = state.conv_states[name] if state is not None and offset > 0 else None
            b, s, h, d = x[name].shape
            y, final = self.kernels.causal_conv1d(x[name].reshape(b, s, h * d), getattr(self, f"conv_{name}").weight,
                                                  initial_state=initial, activation=self.config.conv_activation,
                                                  document_ids=document_ids)
            x[name] = y.view(b, s, h, d)
            if state is not None:
                state.conv_states[name] = final
        self._gate_keys_and_values(x)

        outputs = {}
        if self.has_attention:
            o = self._attend(x[self.attention_query], x["k"], x["v"], reads, cache, state, document_ids)
            if o is not None:
                outputs[Mode.ATTENTION] = o
        if Mode.LINEAR in reads.read or state is not None:  # a kept state absorbs every token
            outputs[Mode.LINEAR], final = self.linear_mixer(x, None if state is None else state.recurrent_state,
                                                            output_final_state=state is not None,
                                                            document_ids=document_ids)
            if state is not None:
                state.recurrent_state = final
        return self._output(self._select(outputs, reads), x["g"])

    def _step(self, hidden: Tensor, reads: Reads, cache: OryxCache, state: OryxLayerCache) -> Tensor:
        """One token per sequence after the cached ones: hidden [b, 1, hidden]."""
        x = {name: t[:, 0] for name, t in self._project(hidden).items()}  # [b, h, width]
        for name in self.conv_streams:
            b, h, d = x[name].shape
            y, state.conv_states[name] = self.kernels.causal_conv1d_step(
                x[name].reshape(b, h * d), state.conv_states[name], getattr(self, f"conv_{name}").weight,
                activation=self.config.conv_activation)
            x[name] = y.view(b, h, d)
        self._gate_keys_and_values(x)

        outputs = {}
        if self.has_attention:
            if state.key is None:
                self._refuse_attention_without_kv_cache(reads)
            else:
                position = cache.position
                q, k = self._rotate(x[self.attention_query][:, None], x["k"][:, None], position.view(1),
                                    cache.seqlen + 1)
                state.append(k, x["v"][:, None], cache.seqlen)
                if Mode.ATTENTION in reads.read:
                    outputs[Mode.ATTENTION] = decode_attention(q, state.key, state.value, position,
                                                               cache.document_start)
        o, state.recurrent_state = self.linear_mixer.step(x, state.recurrent_state)
        outputs[Mode.LINEAR] = o[:, None]
        return self._output(self._select(outputs, reads), x["g"][:, None])

    def _project(self, hidden: Tensor) -> Dict[str, Tensor]:
        """[b, s, hidden] -> stream -> [b, s, h, width]."""
        b, s, _ = hidden.shape
        proj = self.in_proj(hidden).view(b, s, self.heads, -1)
        return dict(zip(self.streams, proj.split(list(self.streams.values()), dim=-1)))

    def _gate_keys_and_values(self, x: Dict[str, Tensor]) -> None:
        """k *= gate(W_KG x), v *= gate(W_VG x) with ``kv_gate`` (in fp32 or wider)."""
        if self.config.kv_gate == "none":
            return
        for name in ("k", "v"):
            x[name] = kv_gate(x[name], x[f"{name}_gate"], self.config.kv_gate)

    def _rotate(self, q: Tensor, k: Tensor, positions, length: int) -> Tuple[Tensor, Tensor]:
        """Rotary embedding (rotate-half) of q, k [b, s, h, d_k] at ``positions`` (a slice, or [s])."""
        if not self.config.attention_rotary:
            return q, k
        cos, sin = rotary_table(length, self.config.head_dim, self.config.rope_theta, q.device, upcast(q).dtype)
        cos, sin = cos[positions], sin[positions]  # [s, d_k]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, reads: Reads, cache: Optional[OryxCache],
                state: Optional[OryxLayerCache], document_ids: Optional[Tensor]) -> Optional[Tensor]:
        """Causal softmax read over every earlier token of the token's document: [b, s, h, d_v] (None when no
        token reads attention). The KV cache stores every token's key and value whatever its mode."""
        offset = 0 if cache is None else cache.seqlen
        end = offset + q.shape[1]
        q, k = self._rotate(q, k, slice(offset, end), end)
        if state is not None:
            if state.key is None:
                return self._refuse_attention_without_kv_cache(reads)
            k, v = state.append(k, v, offset)
            if offset:  # cached keys of earlier documents are not read
                new = document_ids if document_ids is not None else q.new_zeros(q.shape[:2], dtype=torch.long)
                document_ids = cache.key_document_ids(new)  # [b, offset + s]
        if Mode.ATTENTION not in reads.read:
            return None
        if reads.attention_readers is None:
            return self.kernels.causal_attention(q, k, v, document_ids=document_ids)
        return self.kernels.block_sparse_causal_attention(q, k, v, reads.attention_readers, QUERY_BLOCK,
                                                          document_ids=document_ids)

    @staticmethod
    def _refuse_attention_without_kv_cache(reads: Reads) -> None:
        if Mode.ATTENTION in reads.read:
            raise ValueError("a token reads attention but this OryxCache keeps no KV cache (kv_cache=False): "
                             "read linear mode only, or keep the KV cache")

    def _select(self, outputs: Dict[Mode, Tensor], reads: Reads) -> Tensor:
        """Each token's read: [b, s, h, d_v]."""
        if len(outputs) == 1:
            return next(iter(outputs.values()))
        if isinstance(reads.modes, Mode):
            return outputs[reads.modes]
        attention = (reads.modes == Mode.ATTENTION)[:, :, None, None]
        return torch.where(attention, outputs[Mode.ATTENTION], outputs[Mode.LINEAR])

    def _output(self, y: Tensor, gate: Tensor) -> Tensor:
        """Shared per-head norm, output gate and W_O: [b, s, h, d_v] -> [b, s, hidden]."""
        b, s = y.shape[:2]
        return self.out_proj(self.out_norm(y, gate).reshape(b, s, -1))
