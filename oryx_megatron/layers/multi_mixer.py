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

With ``kv_gate`` the shared k_t and v_t are also multiplied by gate(W_KG x_t), gate(W_VG x_t).

Both memories (KV cache and recurrent state) absorb every token whatever its mode;
``modes`` ([b, s], or one ``Mode`` for every token) only chooses which one each token reads,
and only what is read is computed: attention over the query blocks that hold a reader, the
linear scan when a token reads it or its state is kept.

Tensor parallelism splits heads: the fused input projection ``in_proj`` is laid out head-major
(per head: k, v, g, then the mixer-specific queries and scalars), so a plain
column-parallel split hands each rank whole heads and a checkpoint reshards along
dim 0 like any column-parallel weight. Convs, A_log, dt_bias, D and the norm weight
are split with their heads; W_O (``out_proj``) is row-parallel.
"""

import logging
import math
from dataclasses import dataclass
from typing import Dict, FrozenSet, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from oryx_megatron.config import Mode, OryxConfig
from oryx_megatron.layers.head_split import HeadSplitModule
from oryx_megatron.layers.linear_mixers import LINEAR_MIXER_CLASSES
from oryx_megatron.ops import (
    apply_rotary, attention_at, decode_attention, get_kernels, kv_gate, once_per_tensor, rotary_table, upcast,
)

logger = logging.getLogger(__name__)

# per token [b, s] (int; or float: router weights, 0/1 in value, straight-through to the router), one mode for
# every token, or None (single mixer)
Modes = Union[Tensor, Mode, None]


@dataclass
class MultiMixerSubmodules:
    in_proj: Union[ModuleSpec, type]  # column-parallel fused input projection
    core_attention: Union[ModuleSpec, type]  # q, k, v -> o (bottom-right causal)
    out_proj: Union[ModuleSpec, type]  # row-parallel W_O


KV_BLOCK = 256  # KV cache positions allocated at a time


@once_per_tensor
def mode_reads(modes: Tensor) -> Tuple[FrozenSet[Mode], Tensor]:
    """The modes some token of ``modes`` [b, s] reads (a host sync) and the attention readers [b, s]
    bool: once per modes tensor, which every layer of a forward shares."""
    return frozenset(Mode(int(m)) for m in torch.unique(modes).tolist()), modes == Mode.ATTENTION


@dataclass
class MixerSnapshot:
    """What ``MixerCache.restore`` needs to return to an earlier position (speculative decoding)."""

    conv_states: Dict[str, Tensor]
    recurrent_state: Optional[Tensor]
    document_start: Tensor
    seqlen: int


@dataclass
class MixerCache:
    """Inference state of one layer, updated in place on every token whatever its mode.

    Keys and values live in preallocated buffers of ``capacity`` positions (grown by KV_BLOCK
    when a prefill or ``reserve`` needs more); the first ``seqlen`` hold the tokens so far.
    ``position`` is ``seqlen`` as a device tensor: the one-token step reads and advances only it,
    so that step can be captured in a CUDA graph (a replay leaves ``seqlen`` to the caller).
    """

    conv_states: Dict[str, Tensor]  # stream -> [b, channels, conv_kernel - 1]
    key: Optional[Tensor]  # [b, capacity, h, d_k], rotated; None: no KV cache kept
    value: Optional[Tensor]  # [b, capacity, h, d_v]
    recurrent_state: Optional[Tensor]  # [b, h, d_k, d_v] fp32, None for attention-only
    position: Tensor  # 0-dim long, on the device
    document_start: Tensor  # [b] long: where each sequence's current document starts (keys before it are not read)
    seqlen: int = 0

    @property
    def capacity(self) -> int:
        return 0 if self.key is None else self.key.shape[1]

    def reserve(self, n_tokens: int) -> bool:
        """Room for ``n_tokens`` in all; True when the buffers were reallocated (which invalidates a
        captured graph)."""
        if self.key is None or n_tokens <= self.capacity:
            return False
        capacity = -(-n_tokens // KV_BLOCK) * KV_BLOCK
        for name in ("key", "value"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[0], capacity, *old.shape[2:])
            new[:, : self.seqlen] = old[:, : self.seqlen]
            setattr(self, name, new)
        return True

    def append(self, key: Tensor, value: Tensor) -> Tuple[Tensor, Tensor]:
        """Store s new tokens' key/value [b, s, h, d] after the cached ones: (every key, every value)."""
        end = self.seqlen + key.shape[1]
        self.reserve(end)
        self.key[:, self.seqlen : end] = key
        self.value[:, self.seqlen : end] = value
        return self.key[:, :end], self.value[:, :end]

    def write_at_position(self, key: Tensor, value: Tensor) -> None:
        """Store one token's key/value [b, 1, h, d] at ``position`` (no host-side index)."""
        index = self.position.view(1)
        self.key.index_copy_(1, index, key)
        self.value.index_copy_(1, index, value)

    def advance(self, n_tokens: int) -> None:
        self.seqlen += n_tokens
        self.position += n_tokens

    def start_documents(self, starting: Tensor) -> None:
        """The next token of the sequences where ``starting`` [b] bool starts a new document: their
        conv and recurrent states restart from zero and attention reads from here on. In place, no host
        sync (a captured decode graph reads the same buffers)."""
        keep = ~starting
        for state in self.conv_states.values():
            state.mul_(keep[:, None, None].to(state.dtype))
        if self.recurrent_state is not None:
            self.recurrent_state.mul_(keep[:, None, None, None].to(self.recurrent_state.dtype))
        self.document_start.copy_(torch.where(starting, self.position, self.document_start))

    def key_document_ids(self, document_ids: Tensor) -> Tensor:
        """Document ids [b, seqlen + s] of the cached keys and of s new tokens with ``document_ids``
        [b, s]: a cached key of the current document has the first new token's id, earlier ones -1."""
        cached = torch.arange(self.seqlen, device=document_ids.device)[None] >= self.document_start[:, None]
        return torch.cat([torch.where(cached, document_ids[:, :1], -1), document_ids], dim=1)

    def after_documents(self, document_ids: Tensor) -> None:
        """Move ``document_start`` to the last document start among s new tokens (before ``advance``)."""
        starts = F.pad(document_ids[:, 1:] != document_ids[:, :-1], (1, 0))  # [b, s]
        index = torch.arange(starts.shape[1], device=starts.device)
        last = torch.where(starts, index, -1).amax(1)  # [b], -1: no new document
        self.document_start.copy_(torch.where(last >= 0, self.seqlen + last, self.document_start))

    def snapshot(self) -> MixerSnapshot:
        """Copies of the states that tokens overwrite (cached keys past ``seqlen`` are ignored later)."""
        recurrent = None if self.recurrent_state is None else self.recurrent_state.clone()
        return MixerSnapshot({n: t.clone() for n, t in self.conv_states.items()}, recurrent,
                             self.document_start.clone(), self.seqlen)

    def restore(self, snapshot: MixerSnapshot) -> None:
        """Back to the snapshot's position, in place."""
        for name, state in snapshot.conv_states.items():
            self.conv_states[name].copy_(state)
        if snapshot.recurrent_state is not None:
            self.recurrent_state.copy_(snapshot.recurrent_state)
        self.document_start.copy_(snapshot.document_start)
        self.seqlen = snapshot.seqlen
        self.position.fill_(snapshot.seqlen)

    def nbytes(self) -> Dict[str, int]:
        """Allocated bytes: kv / recurrent / conv."""
        kv = 0 if self.key is None else self.key.nbytes + self.value.nbytes
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
        if config.kv_gate != "none":
            self.streams.update(k_gate=self.d_k, v_gate=self.d_v)
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
        modes: Modes = None,
        inference_cache: Optional[MixerCache] = None,
        document_ids: Optional[Tensor] = None,
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """hidden_states [s, b, hidden] (sequence-sharded under SP) -> (out, bias).

        modes: [b, s] per token, or one ``Mode`` read by every token (then only that mixer's
        output is computed); None for a single-mixer layer. With ``inference_cache`` the sequence
        continues the cached one (prefill); one token with a cache is a decode step (``step``).
        document_ids: [b, s] int (full sequence, as modes) or None: packed documents, each read and
        remembered alone (attention within it, every state from zero at its start).
        """
        if inference_cache is not None and inference_cache.seqlen > 0 and hidden_states.shape[0] == 1:
            return self.step(hidden_states, modes, inference_cache)
        x = self._project(hidden_states)  # stream -> [b, s, h, d]
        if self.config.recompute_granularity == "selective" and self.training and inference_cache is None:
            y = checkpoint(self._mix, x, modes, None, document_ids, use_reentrant=False)  # keep the projections only
        else:
            y = self._mix(x, modes, inference_cache, document_ids)
        return self._output(y)

    def _mix(self, x: Dict[str, Tensor], modes: Modes, cache: Optional[MixerCache],
             document_ids: Optional[Tensor] = None) -> Tensor:
        """Projected streams -> each token's read, normed and gated: [b, s, h, d_v]."""
        x = dict(x)  # a recomputation gets the projected streams again
        for name in self.conv_streams:  # shared short convs (and the linear query's)
            state = cache.conv_states[name] if cache is not None and cache.seqlen > 0 else None
            x[name], state = self._conv(x[name], getattr(self, f"conv_{name}"), state, document_ids)
            if cache is not None:
                cache.conv_states[name].copy_(state)
        self._gate_keys_and_values(x)

        reads = self._reads(modes)
        outputs = {}
        if self.has_attention:
            o = self._attend(x[self.attention_query], x["k"], x["v"], cache, modes, reads, document_ids)
            if o is not None:
                outputs[Mode.ATTENTION] = o
        if self.linear_mixer is not None and (Mode.LINEAR in reads or cache is not None):  # the state absorbs all
            initial = cache.recurrent_state if cache is not None else None
            outputs[Mode.LINEAR], state = self.linear_mixer(x, initial, output_final_state=cache is not None,
                                                            document_ids=document_ids)
            if cache is not None:
                cache.recurrent_state.copy_(state)
        if cache is not None:
            if document_ids is not None:
                cache.after_documents(document_ids)
            cache.advance(x["k"].shape[1])
        return self._gated_norm(self._select(outputs, modes), x["g"])

    # ---- one-token decode ----
    def step(
        self, hidden_states: Tensor, modes: Modes, inference_cache: MixerCache, readouts: Optional[Tensor] = None
    ) -> Tuple[Tensor, Optional[Tensor]]:
        """Decode one token: hidden_states [1, b, hidden], modes [b, 1], [b] or a Mode; with ``readouts``
        [b, h, 2, d_v] both mixers read and their reads are written there (``step_readouts``).

        Positions come from the cache's ``position`` tensor and every state is written in place,
        so the step has no host synchronisation and can be captured in a CUDA graph."""
        cache = inference_cache
        x = {name: t.squeeze(1) for name, t in self._project(hidden_states).items()}  # [b, h, d]
        for name in self.conv_streams:
            b, h, d = x[name].shape
            y, state = self.kernels.causal_conv1d_step(
                x[name].reshape(b, h * d), cache.conv_states[name], getattr(self, f"conv_{name}"),
                activation=self.config.mixer_conv_activation,
            )
            cache.conv_states[name].copy_(state)
            x[name] = y.view(b, h, d)
        self._gate_keys_and_values(x)

        if torch.is_tensor(modes):  # per sequence: both mixers read, selected without a host sync
            modes, reads = modes.reshape(-1, 1), frozenset(Mode)
        else:
            reads = self._reads(modes)
        outputs = {}
        if self.has_attention:
            if cache.key is None:
                self._refuse_attention_without_kv_cache(reads)
            else:
                cache.reserve(cache.seqlen + 1)  # host-side; a graph runner reserves before replaying
                q, k = self._rotate(x[self.attention_query][:, None], x["k"][:, None], cache.position.view(1),
                                    cache.capacity)
                cache.write_at_position(k, x["v"][:, None])
                if Mode.ATTENTION in reads or readouts is not None:
                    outputs[Mode.ATTENTION] = decode_attention(q, cache.key, cache.value, cache.position,
                                                               cache.document_start)
        if self.linear_mixer is not None:
            o, state = self.linear_mixer.step(x, cache.recurrent_state)
            outputs[Mode.LINEAR] = o[:, None]
            cache.recurrent_state.copy_(state)
        cache.advance(1)
        gate = x["g"][:, None]
        if readouts is not None:
            readouts.copy_(self._readouts(outputs[Mode.ATTENTION], outputs[Mode.LINEAR], gate)[:, 0])
            outputs = {mode: outputs[mode] for mode in reads if mode in outputs}
        return self._output(self._gated_norm(self._select(outputs, modes), gate))

    def allocate_inference_cache(self, batch_size: int, dtype: torch.dtype, device=None,
                                 capacity: Optional[int] = None, kv_cache: bool = True) -> MixerCache:
        """An empty cache: zero conv and recurrent states, KV buffers of ``capacity`` positions
        (default KV_BLOCK; grown when exceeded), none at all when ``kv_cache`` is False (a cache
        for linear mode only)."""
        h, w = self.num_heads, self.config.mixer_conv_kernel
        conv_states = {
            name: torch.zeros(batch_size, h * self.streams[name], w - 1, dtype=dtype, device=device)
            for name in self.conv_streams
        }
        key = value = None
        if self.has_attention and kv_cache:
            capacity = -(-(capacity or KV_BLOCK) // KV_BLOCK) * KV_BLOCK
            key = torch.zeros(batch_size, capacity, h, self.d_k, dtype=dtype, device=device)
            value = torch.zeros(batch_size, capacity, h, self.d_v, dtype=dtype, device=device)
        recurrent = None
        if self.linear_mixer is not None:
            state_dtype = torch.promote_types(dtype, torch.float32)
            recurrent = torch.zeros(self.linear_mixer.state_shape(batch_size), dtype=state_dtype, device=device)
        position = torch.zeros((), dtype=torch.long, device=device)
        document_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        return MixerCache(conv_states, key, value, recurrent, position, document_start)

    # ---- pieces shared by forward and step ----
    def _project(self, hidden_states: Tensor) -> Dict[str, Tensor]:
        """[s, b, hidden] -> stream -> [b, s, h, width] (all-gathered sequence under SP)."""
        proj, _ = self.in_proj(hidden_states)  # [s, b, h * sum(widths)]
        s, b = proj.shape[:2]
        proj = proj.transpose(0, 1).reshape(b, s, self.num_heads, -1)
        return dict(zip(self.streams, proj.split(list(self.streams.values()), dim=-1)))

    def _conv(self, x: Tensor, weight: Tensor, state: Optional[Tensor],
              document_ids: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
        b, s, h, d = x.shape
        y, final_state = self.kernels.causal_conv1d(
            x.reshape(b, s, h * d), weight, initial_state=state,
            activation=self.config.mixer_conv_activation, document_ids=document_ids,
        )
        return y.view(b, s, h, d), final_state

    def _gate_keys_and_values(self, x: Dict[str, Tensor]) -> None:
        """k *= gate(W_KG x), v *= gate(W_VG x) with ``kv_gate`` (in fp32 or wider)."""
        if self.config.kv_gate == "none":
            return
        for name in ("k", "v"):
            x[name] = kv_gate(x[name], x[f"{name}_gate"], self.config.kv_gate)

    def _reads(self, modes: Modes) -> FrozenSet[Mode]:
        """The modes some token reads: without a host sync for a Mode or a single mixer, with one per
        forward (``mode_reads``) for a modes tensor."""
        if isinstance(modes, Mode):
            return frozenset((modes,))
        if modes is None or not self.config.is_multi_mixer:
            return frozenset((Mode.ATTENTION,) if self.has_attention else (Mode.LINEAR,))
        if modes.is_floating_point():  # router weights: both reads everywhere (``_select``)
            return frozenset(Mode)
        return mode_reads(modes)[0]

    def _rotate(self, q: Tensor, k: Tensor, positions: Union[slice, Tensor], length: int) -> Tuple[Tensor, Tensor]:
        """Rotary embedding of q, k [b, s, h, d_k] at ``positions`` (a slice, or [s] on the device) of
        a shared table of at least ``length`` positions (a no-op without rotary)."""
        return self._rotary(q, positions, length), self._rotary(k, positions, length)

    def _rotary(self, x: Tensor, positions: Union[slice, Tensor], length: int) -> Tensor:
        if not self.config.attention_rotary:
            return x
        cos, sin = rotary_table(length, self.d_k, self.config.rotary_base, x.device, upcast(x).dtype)
        return apply_rotary(x, cos[positions], sin[positions])  # cos, sin [s, d_k]

    # ---- what a router reads (layers/router.py) ----
    def chunk_readouts(self, hidden_states: Tensor, chunk_size: int, document_ids: Optional[Tensor] = None) -> Tensor:
        """Both mixers' reads of the first token of every chunk of ``chunk_size`` positions:
        hidden_states [s, b, hidden] -> [b, ceil(s / chunk_size), h, 2, d_v] (``_readouts``). Neither
        read depends on any token's mode (both memories absorb every token): in the first layer, whose
        input does not depend on modes either, they are known before any mode is chosen."""
        self._require_both_mixers()
        x = self._project(hidden_states)  # stream -> [b, s, h, d]
        for name in self.conv_streams:
            x[name], _ = self._conv(x[name], getattr(self, f"conv_{name}"), None, document_ids)
        self._gate_keys_and_values(x)
        s = x["k"].shape[1]
        starts = torch.arange(0, s, chunk_size, device=x["k"].device)  # [n]
        q = self._rotary(x[self.attention_query][:, starts], starts, s)  # [b, n, h, d_k]
        attention = attention_at(q, self._rotary(x["k"], slice(0, s), s), x["v"], starts, document_ids)
        linear, _ = self.linear_mixer(x, document_ids=document_ids)  # [b, s, h, d_v]
        return self._readouts(attention, linear[:, starts], x["g"][:, starts])

    def step_readouts(self, hidden_states: Tensor, inference_cache: MixerCache) -> Tensor:
        """``chunk_readouts`` of one new token at decode: hidden_states [1, b, hidden] -> [b, 1, h, 2, d_v],
        the cache left as it was (the token's own ``step`` follows, with the mode decided from these)."""
        self._require_both_mixers()
        readouts = hidden_states.new_empty(hidden_states.shape[1], self.num_heads, 2, self.d_v)
        snapshot = inference_cache.snapshot()
        try:  # the step writes the token's key and value, which its real step rewrites
            self.step(hidden_states, Mode.LINEAR, inference_cache, readouts)
        finally:
            inference_cache.restore(snapshot)
        return readouts[:, None]

    def _require_both_mixers(self) -> None:
        if not self.config.is_multi_mixer:
            raise ValueError(f"a router reads both mixers: mixers={self.config.mixers!r} has one")

    def _readouts(self, attention: Tensor, linear: Tensor, gate: Tensor) -> Tensor:
        """[b, n, h, d_v] reads and their gate -> [b, n, h, 2, d_v]: per head the attention read minus
        the linear one, and the linear one, each normed and gated as the layer's output is."""
        y_attention, y_linear = (self._gated_norm(y, gate) for y in (attention, linear))
        return torch.stack([y_attention - y_linear, y_linear], dim=-2)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cache: Optional[MixerCache], modes: Modes,
                reads: FrozenSet[Mode], document_ids: Optional[Tensor]) -> Optional[Tensor]:
        """Causal softmax read over all earlier tokens (cached ones included) of the token's document
        at the positions that read attention: [b, s, h, d_v], or None when no token reads it. The cache
        stores every token's key and value whatever its mode."""
        offset = cache.seqlen if cache is not None else 0
        end = offset + q.shape[1]
        q, k = self._rotate(q, k, slice(offset, end), end)
        if cache is not None:
            if cache.key is None:
                return self._refuse_attention_without_kv_cache(reads)
            k, v = cache.append(k, v)
            if offset:  # the cached keys of earlier documents (MixerCache.start_documents) are not read
                new = document_ids if document_ids is not None else q.new_zeros(q.shape[:2], dtype=torch.long)
                document_ids = cache.key_document_ids(new)  # [b, offset + s]
        if Mode.ATTENTION not in reads:
            return None
        dense = isinstance(modes, Mode) or modes is None or modes.is_floating_point()
        read = None if dense else mode_reads(modes)[1]  # [b, s]
        return self.core_attention(q, k, v, read, document_ids)

    def _refuse_attention_without_kv_cache(self, reads: FrozenSet[Mode]) -> None:
        if Mode.ATTENTION in reads:
            raise ValueError("a token reads attention but this inference cache keeps no KV cache "
                             "(kv_cache=False, --no-kv-cache): use a linear-only schedule, or keep the KV cache")

    def _select(self, outputs: Dict[Mode, Tensor], modes: Modes) -> Tensor:
        """Each token reads with its mode's mixer: [b, s, h, d_v]."""
        if isinstance(modes, Mode):
            return outputs[modes]
        if len(self.config.mixer_list) == 1:
            return next(iter(outputs.values()))
        if modes is None:
            raise ValueError(f"modes [batch, seq] is required by a multi-mixer layer (mixers={self.config.mixers})")
        if len(outputs) == 1:  # every token reads the one computed
            return next(iter(outputs.values()))
        if modes.is_floating_point():  # [b, s] router weights w: 0/1 in value, a gradient to the router
            w = modes[:, :, None, None].to(outputs[Mode.LINEAR].dtype)
            return outputs[Mode.LINEAR] + w * (outputs[Mode.ATTENTION] - outputs[Mode.LINEAR])
        attention = (modes == Mode.ATTENTION)[:, :, None, None]
        return torch.where(attention, outputs[Mode.ATTENTION], outputs[Mode.LINEAR])

    def _gated_norm(self, y: Tensor, gate: Tensor) -> Tensor:
        """Shared per-head norm and output gate: [b, s, h, d_v]. Each head is normalised on its own,
        which brings both mixers to one scale before the shared gate and W_O and keeps tensor
        parallelism (heads split over ranks) exact."""
        return self.kernels.gated_rms_norm(y, gate, self.out_norm_weight, self.config.layernorm_epsilon)

    def _output(self, y: Tensor) -> Tuple[Tensor, Optional[Tensor]]:
        """Shared W_O: [b, s, h, d_v] -> [s, b, hidden]."""
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
