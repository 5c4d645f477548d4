"""The Oryx multi-mixer: causal softmax attention and a linear recurrent mixer (Gated DeltaNet, Mamba-2, ...:
``mixer/linear``) sharing keys, values, output gate and output projection. Written once, in plain torch: the
megatron layer (layers/multi_mixer.py) and the Hugging Face model (hf/modeling.py) build it from their parts.

Per token t and head h (docs/design.md, section 2):

    shared     k_t = act(conv_k(W_K x))_t     v_t = act(conv_v(W_V x))_t     g_t = W_G x_t
    attention  o_t = softmax-attention(rope(W_QA x_t), rope(k_{<=t}), v_{<=t})
    gdn        S_t = (I - b_t k_t k_t^T) exp(a_t) S_{t-1} + b_t k_t v_t^T,  o_t = S_t^T q_t / sqrt(d_k)
               (q, k L2-normalised; q_t = act(conv_q_lin(W_QL x))_t)
    mamba2     S_t = exp(A dt_t) S_{t-1} + dt_t k_t v_t^T,                 o_t = S_t^T q_t + D v_t
    output     out_t = W_O( RMSNorm_per_head(o_t of the token's mode) * silu(g_t) )

With ``shared_query`` (ablation A1) attention reads with the linear query q_t instead of W_QA x_t; with
``kv_gate`` the shared k_t and v_t are also multiplied by gate(W_KG x_t), gate(W_VG x_t).

Both memories (KV cache and recurrent state) absorb every token whatever its mode; the forward's
``MixerContext`` says which mixer each token reads, and the parallel forward computes only what is read: attention
over the query blocks that hold a reader (the spec's core attention may compute it densely: TE's does), the linear
scan when a token reads it or its state is kept. A one-token decode step with per-token modes computes both
(each sequence selects its own, without a host sync).

All streams come from one head-major projection ``in_proj`` (``MixerLayout``), so tensor parallelism splits
heads: a column-parallel ``in_proj`` hands each rank whole heads, the convs, norm weight and the linear mixer's
scalars are split with their heads (``HeadShard``), and ``out_proj`` is row-parallel.

Both front ends hold this class the same way, built from their parts: the Hugging Face model with plain
``nn.Linear`` projections over [b, s, hidden], megatron's layer (layers/multi_mixer.py) with its parallel linears
over [s, b, hidden] (``sequence_first``). What a router reads of it, and the routing pass, are mixer/router.py's;
the inference state it reads and writes, ``MixerCache``'s (mixer/state.py).
"""

from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from oryx_megatron.config import MixerConfig, Mode
from oryx_megatron.mixer.attention import SDPAttention
from oryx_megatron.mixer.context import MixerContext
from oryx_megatron.mixer.heads import GatedRMSNorm, HeadModule, HeadShard, ShortConv
from oryx_megatron.mixer.layout import MixerLayout
from oryx_megatron.mixer.linear import linear_mixer_class
from oryx_megatron.mixer.state import MixerCache, kv_capacity
from oryx_megatron.ops import (
    Documents,
    apply_rotary,
    attention_at,
    compute_dtype,
    decode_attention,
    get_kernels,
    kv_gate,
    rotary_table,
)

class OryxMixer(HeadModule):
    """Hidden states [b, s, hidden] in and out ([s, b, hidden] with ``sequence_first``), through ``in_proj`` and
    ``out_proj``: plain ``nn.Linear`` unless a front end passes its own (a projection may return (output, bias), as
    megatron's linears do: the input projection has no bias, and what ``out_proj`` returns is the mixer's output);
    ``core_attention``: the attention slot (default ``SDPAttention``); ``hidden_proj``: the projection of the hidden
    state to the linear mixer's cross-head features (``MixerLayout.hidden_features``; none unless it declares
    some), every feature of every token on every rank, in the front end's layout."""

    def __init__(self, config: MixerConfig, shard: HeadShard = HeadShard(), in_proj: Optional[nn.Module] = None,
                 out_proj: Optional[nn.Module] = None, core_attention: Optional[nn.Module] = None,
                 sequence_first: bool = False, hidden_proj: Optional[nn.Module] = None):
        super().__init__(config, shard)
        self.sequence_first = sequence_first
        self.layout = MixerLayout.of(config)
        self.kernels = get_kernels(config.kernel_backend)
        self.d_k, self.d_v = config.kv_channels, config.value_head_dim
        heads, make = config.num_attention_heads, dict(dtype=shard.dtype, device=shard.device)
        if in_proj is None:
            in_proj = nn.Linear(config.hidden_size, heads * self.layout.width, bias=False, **make)
        self.in_proj = in_proj
        if self.layout.hidden_features:
            features = sum(self.layout.hidden_features.values())
            self.hidden_proj = nn.Linear(config.hidden_size, features, bias=False, **make) if hidden_proj is None \
                else hidden_proj
        if self.layout.attention_query is not None:
            self.core_attention = SDPAttention(config) if core_attention is None else core_attention
        self.out_proj = nn.Linear(heads * self.d_v, config.hidden_size, bias=False, **make) if out_proj is None \
            else out_proj
        for name in self.layout.conv_streams:  # conv_k, conv_v, conv_q_lin, ...
            self.add_module(f"conv_{name}", ShortConv(config, shard, self.layout.streams[name]))
        self.out_norm = GatedRMSNorm(config, shard, self.kernels)
        linear = linear_mixer_class(config)
        self.linear_mixer = None if linear is None else linear(config, shard, self.kernels)
        self.recompute = False  # keep only the projections for the backward (megatron's selective recompute)

    # ---- the parallel forward (training, prefill) ----
    def forward(self, hidden: Tensor, context: MixerContext, cache: Optional[MixerCache] = None):
        """hidden [b, s, hidden] -> [b, s, hidden]. With ``cache`` the tokens continue the cached ones (prefill);
        hidden [b, hidden], one token per sequence after cached ones, is a decode step (``step``)."""
        cp = self.shard.cp
        if cache is not None and cp.size > 1:
            raise ValueError("inference caches run at context_parallel_size=1: context parallelism splits the "
                             "sequence of a parallel forward (training, evaluation)")
        if hidden.dim() == 2:
            return self.step(hidden, context, cache)
        x = self._streams(cp.to_heads(self._projection(hidden)))  # stream -> [b, s, h (/ cp), width]
        x.update(self._hidden_features(hidden))  # feature -> [b, s, width]: every token
        if self.recompute and self.training and cache is None and context.readouts is None:
            y = checkpoint(self._mix, x, context, None, use_reentrant=False)
        else:
            y = self._mix(x, context, cache)
        return self._output(cp.to_sequence(y))

    def _mix(self, x: Dict[str, Tensor], context: MixerContext, cache: Optional[MixerCache]) -> Tensor:
        """Projected streams -> each token's read, normed and gated: [b, s, h, d_v]."""
        x = dict(x)  # a recomputation gets the projected streams again
        convolved, conv_state = self._conv(x, None if cache is None else cache.initial_conv_state(), context.documents)
        x.update(convolved)  # shared short convs (and the linear query's)
        self._gate_keys_and_values(x)

        outputs, recurrent_state = {}, None
        if self.layout.attention_query is not None:
            o = self._attend(x[self.layout.attention_query], x["k"], x["v"], context, cache)
            if o is not None:
                outputs[Mode.ATTENTION] = o
        if self.linear_mixer is not None and (Mode.LINEAR in context.reads or cache is not None):  # absorbs all
            outputs[Mode.LINEAR], recurrent_state = self.linear_mixer(
                x, None if cache is None else cache.recurrent_state, output_final_state=cache is not None,
                documents=context.documents)
        if context.readouts is not None:
            if cache is not None and cache.seqlen > 0:
                raise ValueError("the router reads a sequence from its start: route the whole prompt in one prefill")
            context.readouts.reads.append(self._chunk_readouts(x, outputs[Mode.LINEAR], context.readouts.chunk_size,
                                                               context.document_ids))
        if cache is not None:
            cache.absorb(conv_state, recurrent_state, x["k"].shape[1], context.document_ids)
        return self._gated_norm(self._select(outputs, context), x["g"])

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, context: MixerContext,
                cache: Optional[MixerCache]) -> Optional[Tensor]:
        """Causal softmax read over all earlier tokens (cached ones included) of the token's document: [b, s, h,
        d_v], or None when no token reads it. The cache stores every token's key and value whatever its mode."""
        offset = cache.seqlen if cache is not None else 0
        end = offset + q.shape[1]
        q, k = self._rotate(q, k, slice(offset, end), end)
        document_ids = context.document_ids
        if cache is not None:
            if cache.key is None:
                return self._refuse_attention_without_kv_cache(context)
            cache.append(k, v)
        if Mode.ATTENTION not in context.reads:
            return None
        if cache is not None:
            if cache.engine_kv is not None:  # an engine's kernel reads its pages
                return cache.engine_kv.attend(q)
            k, v = cache.cached(end)
            if offset:  # the cached keys of earlier documents (MixerCache.start_documents) are not read
                new = document_ids if document_ids is not None else q.new_zeros(q.shape[:2], dtype=torch.long)
                document_ids = cache.key_document_ids(new)  # [b, offset + s]
        return self.core_attention(q, k, v, context.attention_readers, document_ids)

    # ---- one-token decode ----
    def step(self, hidden: Tensor, context: MixerContext, cache: MixerCache):
        """Decode one token per sequence: hidden [b, hidden] -> [b, hidden] (either front end's layout: the front
        ends hand their layers [b, hidden] at a decode step); ``context`` built with ``decode=True`` (or one Mode).
        With ``context.readouts`` both mixers read and their reads are appended there, [b, 1, h, 2, d_v].
        Positions come from the cache's ``position`` tensor (one for the batch, or each sequence's: rotary, KV
        write and attention read per sequence) and every state is written in place: no host synchronisation, so
        the step can be captured in a CUDA graph."""
        x = self._streams(self._projection(hidden))  # stream -> [b, h, width]
        x.update(self._hidden_features(hidden))  # cross-head: [b, width]
        joint = self._conv_input(x)  # [b, h, conv width]
        b, h, c = joint.shape
        if cache.conv_weight is None or torch.is_grad_enabled():
            cache.conv_weight = self._conv_weight()  # the weights stay while the cache is in use
        y, conv_state = self.kernels.causal_conv1d_step(joint.view(b, h * c), cache.conv_state, cache.conv_weight,
                                                        activation=self.config.mixer_conv_activation)
        x.update(self._conv_output(y.view(b, h, c)))
        self._gate_keys_and_values(x)

        outputs, recurrent_state = {}, None
        if self.layout.attention_query is not None:
            if cache.key is None:
                self._refuse_attention_without_kv_cache(context)
            else:
                cache.reserve(cache.seqlen + 1)  # host-side; a graph runner reserves before replaying
                position = cache.position.view(1) if cache.position.dim() == 0 else cache.position[:, None]
                rotary = self._rotary_at(position, cache.capacity, x["k"])  # cos, sin [1 or b, 1, d_k]
                cache.write_at_position(self._rotary(x["k"][:, None], rotary), x["v"][:, None])
                if Mode.ATTENTION in context.reads or context.readouts is not None:  # the query only where read
                    q = self._rotary(x[self.layout.attention_query][:, None], rotary)
                    eager = hidden.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
                    length = cache.seqlen + 1 if eager else None
                    outputs[Mode.ATTENTION] = cache.engine_kv.attend(q) if cache.engine_kv is not None else decode_attention(
                        q, *cache.cached(length), cache.position, cache.document_start if cache.documents else None,
                        length=length)
        if self.linear_mixer is not None:
            o, recurrent_state = self.linear_mixer.step(x, cache.recurrent_state)
            outputs[Mode.LINEAR] = o[:, None]
        cache.absorb(conv_state, recurrent_state, 1)
        gate = x["g"][:, None]
        if context.readouts is not None:
            context.readouts.reads.append(self._readouts(outputs[Mode.ATTENTION], outputs[Mode.LINEAR], gate))
            outputs = {mode: outputs[mode] for mode in context.reads if mode in outputs}
        y = self._gated_norm(self._select(outputs, context), gate)  # [b, 1, h, d_v]
        return self.out_proj(y.reshape(y.shape[0], -1))

    def allocate_inference_cache(self, batch_size: int, dtype: torch.dtype, device=None,
                                 capacity: Optional[int] = None, kv_cache: bool = True) -> MixerCache:
        """An empty cache: zero conv and recurrent states (every tensor of ``LinearMixer.state_spec``), KV buffers of
        ``capacity`` positions in whole blocks (``state.kv_capacity``; grown when exceeded), none at all when
        ``kv_cache`` is False (linear mode only) in an Oryx block; an attention layer of a layer pattern keeps its
        KV cache whatever ``kv_cache`` says."""
        h, w = self.num_heads, self.config.mixer_conv_kernel
        conv_state = torch.zeros(batch_size, h * self.layout.conv_width, w - 1, dtype=dtype, device=device)
        key = value = None
        if self.layout.attention_query is not None and (kv_cache or not self.config.is_multi_mixer):
            capacity = kv_capacity(capacity)
            key = torch.zeros(batch_size, capacity, h, self.d_k, dtype=dtype, device=device)
            value = torch.zeros(batch_size, capacity, h, self.d_v, dtype=dtype, device=device)
        spec = {} if self.linear_mixer is None else self.linear_mixer.state_spec(batch_size, dtype)
        recurrent = {name: torch.zeros(shape, dtype=state_dtype, device=device)
                     for name, (shape, state_dtype) in spec.items()}  # name -> [b, h, ...]
        position = torch.zeros((), dtype=torch.long, device=device)
        document_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        return MixerCache(conv_state, key, value, recurrent, position, document_start)

    # ---- what a router reads (mixer/router.py), on the way of a forward or step ----
    def _chunk_readouts(self, x: Dict[str, Tensor], linear: Tensor, chunk_size: int,
                        document_ids: Optional[Tensor]) -> Tensor:
        """Both mixers' reads (``_readouts``) of the first token of every chunk of ``chunk_size`` positions, from the
        convolved streams and the linear read [b, s, h, d_v] of a whole sequence: [b, ceil(s / chunk_size), h, 2,
        d_v] (under context parallelism from this rank's heads, every head gathered)."""
        s = x["k"].shape[1]
        starts = torch.arange(0, s, chunk_size, device=x["k"].device)  # [n]
        q = self._rotary(x[self.layout.attention_query][:, starts], self._rotary_at(starts, s, x["k"]))  # [b, n, h, d]
        k = self._rotary(x["k"], self._rotary_at(slice(0, s), s, x["k"]))
        attention = attention_at(q, k, x["v"], starts, document_ids)
        return self.shard.cp.all_heads(self._readouts(attention, linear[:, starts], x["g"][:, starts]))

    def _readouts(self, attention: Tensor, linear: Tensor, gate: Tensor) -> Tensor:
        """[b, n, h, d_v] reads and their gate -> [b, n, h, 2, d_v]: per head the attention read minus the
        linear one, and the linear one, each normed and gated as the layer's output is."""
        y_attention, y_linear = (self._gated_norm(y, gate) for y in (attention, linear))
        return torch.stack([y_attention - y_linear, y_linear], dim=-2)

    # ---- pieces shared by forward and step ----
    def _projection(self, hidden: Tensor) -> Tensor:
        """The fused input projection: [b, s, hidden] ([s, b, hidden]: all-gathered sequence under megatron's
        sequence parallelism) -> [b, s, h, width of every stream]; a step's [b, hidden] -> [b, h, width]."""
        proj = self.in_proj(hidden)
        proj = proj[0] if isinstance(proj, tuple) else proj  # (output, None): megatron's linear without bias
        if proj.dim() == 2:
            return proj.view(proj.shape[0], self.num_heads, -1)
        if self.sequence_first:
            proj = proj.transpose(0, 1)
        b, s = proj.shape[:2]
        return proj.reshape(b, s, self.num_heads, -1)

    def _streams(self, proj: Tensor) -> Dict[str, Tensor]:
        """[b, s, h, width of every stream] -> stream -> [b, s, h, width] (``MixerLayout``)."""
        return dict(zip(self.layout.streams, proj.split(list(self.layout.streams.values()), dim=-1)))

    def _hidden_features(self, hidden: Tensor) -> Dict[str, Tensor]:
        """The linear mixer's cross-head features of the hidden state: feature -> [b, s, width], every token of the
        sequence (gathered over context-parallel ranks), or a step's [b, width]; none unless it declares some."""
        if not self.layout.hidden_features:
            return {}
        y = self.hidden_proj(hidden)
        if y.dim() == 3:  # a step's [b, width] is every token already
            y = self.shard.cp.all_tokens(y.transpose(0, 1) if self.sequence_first else y)
        return dict(zip(self.layout.hidden_features, y.split(list(self.layout.hidden_features.values()), dim=-1)))

    def _output(self, y: Tensor):
        """Shared W_O: [b, s, h, d_v] -> [b, s, hidden] ([s, b, hidden]), as ``out_proj`` returns it."""
        y = y.reshape(*y.shape[:2], -1)
        return self.out_proj(y.transpose(0, 1).contiguous() if self.sequence_first else y)

    def _conv(self, x: Dict[str, Tensor], state: Optional[Tensor],
              documents: Optional[Documents]) -> Tuple[Dict[str, Tensor], Tensor]:
        """The short convs of a sequence's conv streams: stream -> [b, s, h, width] of each, and the final state
        [b, h * conv width, w - 1] (``_conv_weight``)."""
        joint = self._conv_input(x)  # [b, s, h, conv width]
        b, s, h, c = joint.shape
        y, final_state = self.kernels.causal_conv1d(
            joint.view(b, s, h * c), self._conv_weight(), initial_state=state,
            activation=self.config.mixer_conv_activation, documents=documents,
        )
        return self._conv_output(y.view(b, s, h, c)), final_state

    def _conv_input(self, x: Dict[str, Tensor]) -> Tensor:
        """The conv streams side by side per head: [.., h, conv width]."""
        return torch.cat([x[name] for name in self.layout.conv_streams], dim=-1)

    def _conv_output(self, y: Tensor) -> Dict[str, Tensor]:
        """[.., h, conv width] -> stream -> [.., h, width] (views)."""
        return dict(zip(self.layout.conv_streams, y.split(self.layout.conv_widths, dim=-1)))

    def _conv_weight(self) -> Tensor:
        """The conv streams' short convs (``conv_<stream>.weight`` [h * width, w] each) as one depthwise conv over
        their channels side by side per head: [h * conv width, w] (h: this rank's heads, its context-parallel share
        in a parallel forward). A depthwise conv computes every channel on its own, so one conv over the joint
        channels gives each stream's conv, in one kernel call."""
        w = self.config.mixer_conv_kernel
        weights = [getattr(self, f"conv_{name}").local("weight").view(-1, width, w)
                   for name, width in zip(self.layout.conv_streams, self.layout.conv_widths)]
        return torch.cat(weights, dim=1).view(-1, w)

    def _gate_keys_and_values(self, x: Dict[str, Tensor]) -> None:
        """k *= gate(W_KG x), v *= gate(W_VG x) with ``kv_gate`` (in fp32 or wider)."""
        if self.config.kv_gate == "none":
            return
        for name in ("k", "v"):
            x[name] = kv_gate(x[name], x[f"{name}_gate"], self.config.kv_gate)

    def _rotate(self, q: Tensor, k: Tensor, positions: Union[slice, Tensor], length: int) -> Tuple[Tensor, Tensor]:
        """Rotary embedding of q, k [b, s, h, d_k] at ``positions`` (a slice, or [s] on the device) of a shared
        table of at least ``length`` positions (a no-op without rotary)."""
        rotary = self._rotary_at(positions, length, q)
        return self._rotary(q, rotary), self._rotary(k, rotary)

    def _rotary(self, x: Tensor, rotary: Optional[Tuple[Tensor, Tensor]]) -> Tensor:
        """x [b, s, h, d_k] rotated by ``rotary`` (cos, sin of ``_rotary_at``; None: no rotary)."""
        return x if rotary is None else apply_rotary(x, *rotary)

    def _rotary_at(self, positions: Union[slice, Tensor], length: int, x: Tensor) -> Optional[Tuple[Tensor, Tensor]]:
        """cos, sin [s, d_k] at ``positions`` of the shared table (in x's compute dtype); None without rotary."""
        if not self.config.attention_rotary:
            return None
        cos, sin = rotary_table(length, self.d_k, self.config.rotary_base, x.device, compute_dtype(x))
        return cos[positions], sin[positions]

    @staticmethod
    def _refuse_attention_without_kv_cache(context: MixerContext) -> None:
        if Mode.ATTENTION in context.reads:
            raise ValueError("a token reads attention but this inference cache keeps no KV cache "
                             "(kv_cache=False, --no-kv-cache): use a linear-only schedule, or keep the KV cache")

    def _select(self, outputs: Dict[Mode, Tensor], context: MixerContext) -> Tensor:
        """Each token reads with its mode's mixer: [b, s, h, d_v]."""
        if isinstance(context.modes, Mode):
            return outputs[context.modes]
        if len(outputs) == 1:  # every token reads the one computed
            return next(iter(outputs.values()))
        attention, linear = outputs[Mode.ATTENTION], outputs[Mode.LINEAR]
        if context.router_weights is not None:  # 0/1 in value, a gradient to the router
            return linear + context.router_weights[:, :, None, None].to(linear.dtype) * (attention - linear)
        return torch.where((context.modes == Mode.ATTENTION)[:, :, None, None], attention, linear)

    def _gated_norm(self, y: Tensor, gate: Tensor) -> Tensor:
        """Shared per-head norm and output gate: [b, s, h, d_v] (``GatedRMSNorm``)."""
        return self.out_norm(y, gate)
