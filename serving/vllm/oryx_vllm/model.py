"""``OryxForCausalLM`` inside vLLM: the folder's own model computes (its one mixer core, every layer updating the
KV cache and the recurrent state on every token), vLLM owns the memory, as it does for its own hybrid models
(``IsHybrid``): each layer's keys and values are a vLLM attention layer's paged KV cache (``Attention``, an
attention KV spec: a request holds pages for the tokens it has), and the layer's short convs' states and each
tensor of its recurrent state (``LinearMixer.state_spec``) are one vLLM "mamba" state of that layer
(``OryxLayerState``), a slot per running request. vLLM allocates both, hands each request its pages and slot and
keeps them across chunked-prefill steps and decode steps. A token of either mode writes its key and value there:
vLLM's CPU attention kernels write and read the pages in place (``MixerCache.engine_kv``: ``KernelKV``) where
they take the layer's head sizes, else the core does (``MixerCache.block_table``).

A step's decoding requests (one token each, at positions of their own) run as one batch through the core, one
call per layer: each request at its own position (``MixerCache.position`` [b]) in its own pages, the conv and
recurrent states of the batch's slots gathered before the layer and written back after it, and each request reads
the mode of its own schedule at its position. The step's prefill chunks of one start and one length (new prompts
of one length, above all) run as one batch the same way; the core's packed documents would restart every chunk
from zero states, where a chunk continues its request's. Schedules come from ``oryx_vllm.requests`` (the
request's ``oryx_schedule``, else the deployment's ``serving_schedule``, docs/serving.md), so requests of
different schedules share a batch."""

import dataclasses
from functools import lru_cache
from typing import Iterable, List, Optional, Set, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from vllm import _custom_ops as ops, envs
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from oryx_vllm import OryxServingError
from oryx_vllm.core import load_core
from oryx_vllm.limits import serving_schedule
from oryx_vllm.requests import ROWS


RECURRENT = "recurrent_state."  # the entries of the recurrent state's tensors: recurrent_state.<name>


def state_layout(mixer) -> Tuple[List[str], List[tuple], List[torch.dtype]]:
    """Names, per-slot shapes and dtypes of one layer's state, one vLLM state entry per tensor: conv_state and each
    tensor of the linear mixer's state (``recurrent_state.<name>``: ``LinearMixer.state_spec``)."""
    cache = mixer.allocate_inference_cache(1, torch.get_default_dtype(), device="meta", kv_cache=False)
    entries = {"conv_state": cache.conv_state, **{RECURRENT + name: t for name, t in cache.recurrent_state.items()}}
    return list(entries), [tuple(t.shape[1:]) for t in entries.values()], [t.dtype for t in entries.values()]


@lru_cache(maxsize=None)
def folder_state_layouts(folder: str, dtype: torch.dtype) -> List[Tuple[List[str], List[tuple], List[torch.dtype]]]:
    """Each layer's ``state_layout`` in the folder's model, built on the meta device (vLLM sizes its pages before it
    builds the model)."""
    from transformers import AutoConfig

    core = load_core(folder)
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = core.model_class(config)
        return [state_layout(layer.mixer) for layer in model.model.layers]
    finally:
        torch.set_default_dtype(default)


def keeps_kv(mixer) -> bool:
    """Whether the layer's mixer keeps keys and values (a layer pattern's linear layers do not)."""
    return mixer.allocate_inference_cache(1, torch.float32, device="meta", capacity=1).key is not None


class OryxLayerState(MambaBase, nn.Module):
    """One layer's conv and recurrent states as vLLM cache memory: ``kv_cache`` holds a tensor [slots, *shape] per
    entry of ``state_layout``; ``batch_cache`` is the core's MixerCache of a batch of requests over their slots'
    states and their pages of keys and values (``KVPages``)."""

    def __init__(self, mixer, mixer_cache_class, largest_page: int, kv_bytes_per_token: int, prefix: str):
        super().__init__()
        self.names, self.shapes, self.dtypes = state_layout(mixer)
        self.mixer_cache_class, self.prefix = mixer_cache_class, prefix
        self.largest_page, self.kv_bytes_per_token = largest_page, kv_bytes_per_token
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)
        self.conv_weight = None  # the layer's joint conv weight (MixerCache.conv_weight), made at its first decode

    def get_state_shape(self) -> Iterable[tuple]:
        return self.shapes

    def get_state_dtype(self) -> tuple:
        return tuple(self.dtypes)

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> MambaSpec:
        """vLLM's spec, every layer's slot padded to one page: the KV pages' (vLLM sized them to hold the largest
        slot, counting values of the keys' head size), else the largest layer's (a layer pattern's layers differ)."""
        page = self.largest_page
        if self.kv_bytes_per_token:
            page = vllm_config.cache_config.block_size * self.kv_bytes_per_token
            if page < self.largest_page:
                size = vllm_config.cache_config.block_size
                needed = -(-self.largest_page // self.kv_bytes_per_token // 32) * 32
                raise OryxServingError(f"oryx-vllm: --block-size {size}: a page of keys and values ({page} bytes) is "
                                       f"smaller than a layer's states ({self.largest_page} bytes); pass --block-size "
                                       f"{needed}")
        return dataclasses.replace(super().get_kv_cache_spec(vllm_config), page_size_padded=page)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA1  # its metadata only: slots, query starts; no kernel of it runs

    def batch_cache(self, slots: Tensor, positions: Tensor, longest: int, fresh: Optional[Tensor], pages):
        """The MixerCache of a batch of requests, each at its own position (``positions`` [b], its first token of
        this step, all equal for prefill chunks; ``longest``: their largest): each request's conv and recurrent
        states gathered from its slot (``slots`` [b]; zeros where ``fresh`` [b] (None: nowhere), a request at
        position 0, whose slot may hold an earlier request's; ``scatter`` writes them back), keys and values read
        and written in its pages (``pages``: the layer's key and value pages, the batch's block table and vLLM's
        kernels over them, ``KVPages.kernels``; or None)."""
        gathered = {name: t.index_select(0, slots) for name, t in zip(self.names, self.kv_cache)}
        if fresh is not None:
            for t in gathered.values():
                t.masked_fill_(fresh.view(-1, *(1,) * (t.dim() - 1)), 0)
        recurrent = {name[len(RECURRENT):]: t for name, t in gathered.items() if name.startswith(RECURRENT)}
        key, value, table, kernels = (None,) * 4 if pages is None else pages
        return self.mixer_cache_class(gathered["conv_state"], key, value, recurrent, positions.clone(),
                                      torch.zeros_like(positions), longest, conv_weight=self.conv_weight,
                                      block_table=table, engine_kv=kernels)

    def scatter(self, cache, slots: Tensor) -> None:
        """Write a batch's conv and recurrent states back into their slots (and keep its conv weight: the weights
        do not change while the engine serves)."""
        self.conv_weight = cache.conv_weight
        for name, t in zip(self.names, self.kv_cache):
            if name == "conv_state":
                t[slots] = cache.conv_state
            else:
                t[slots] = cache.recurrent_state[name[len(RECURRENT):]]


@dataclasses.dataclass
class PageBatch:
    """A batch of the step's requests (b of them, s tokens each from a position of its own) in one vLLM KV cache
    group, as vLLM's CPU attention kernels read it, built once per batch and group: block table [b, n], each
    token's place in the pages (``slots`` [b * s]), query starts [b + 1] and sequence lengths [b] after the s
    tokens (int32, as vLLM's own metadata), and the kernel's split of the work (``schedule``)."""

    table: Tensor
    slots: Tensor
    query_start: Tensor
    seq_lens: Tensor
    schedule: Optional[Tensor]  # None: the core writes and reads the pages (KVPages.in_place is False)

    @classmethod
    def of(cls, kv: "KVPages", meta, rows: List[int], tokens: Tensor, starts: List[int]) -> "PageBatch":
        """``meta``: the step's attention metadata of ``kv``'s group; ``rows``: the requests' places in the step;
        ``tokens`` [b] or [b, s]: their tokens' places."""
        length = tokens.shape[1] if tokens.dim() == 2 else 1
        query_start = torch.arange(0, len(rows) * length + 1, length, dtype=torch.int32)
        seq_lens = torch.tensor(starts, dtype=torch.int32) + length
        schedule = None
        if kv.in_place:
            schedule = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=len(rows), num_heads=kv.num_heads, num_kv_heads=kv.num_kv_heads, head_dim=kv.head_size,
                seq_lens=seq_lens, dtype=kv.kv_cache.dtype, query_start_loc=query_start, causal=True,
                sliding_window_size=-1, isa=kv.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        return cls(meta.block_table[rows], meta.slot_mapping[tokens.flatten()], query_start, seq_lens, schedule)


class KVPages(Attention):
    """One layer's keys and values in vLLM's paged KV cache: a vLLM attention layer (vLLM sizes, allocates and
    assigns its pages, and hands the step its block table). vLLM's CPU attention kernels write and read them in
    their layout where they can (``in_place``: keys and values of one head size they support: ``kernels``), else
    the core writes and reads them in its own (``pages``)."""

    @property
    def in_place(self) -> bool:
        return (self.head_size == self.head_size_v and hasattr(self, "isa")  # isa: set by vLLM's CPU backend
                and self.head_size in CPUAttentionBackend.get_supported_head_sizes())

    def pages(self) -> Tuple[Tensor, Tensor]:
        """(key pages [pages, page size, h, d_k], value pages [.., d_v]) in the core's layout (``MixerCache``):
        views of vLLM's tensor [pages, h, page size, d_k + d_v], each page's each head its keys, then its values
        (the kernels' split of it: ``_head_major``)."""
        key, value = self._head_major()
        return key.transpose(1, 2), value.transpose(1, 2)

    def _head_major(self) -> Tuple[Tensor, Tensor]:
        """(key pages [pages, h, page size, d_k], value pages [.., d_v]): views of vLLM's tensor, as vLLM's CPU
        attention splits it (``cpu_attn.py``)."""
        pages, heads, size, _ = self.kv_cache.shape
        key, value = self.kv_cache.view(pages, heads, -1).split([size * self.head_size, size * self.head_size_v], 2)
        return key.view(pages, heads, size, -1), value.view(pages, heads, size, -1)

    def kernels(self, batch: PageBatch) -> Optional["KernelKV"]:
        """The batch's writes and reads through vLLM's kernels (``MixerCache.engine_kv``), or None."""
        return None if batch.schedule is None else KernelKV(self, batch, *self._head_major())


@dataclasses.dataclass
class KernelKV:
    """A layer's keys and values written and read by vLLM's CPU attention kernels (``EngineKV`` of the core's
    ``MixerCache``), for one batch: the kernels keep their own layout (keys transposed within a page)."""

    layer: KVPages
    batch: PageBatch
    key_cache: Tensor
    value_cache: Tensor

    def write(self, key: Tensor, value: Tensor) -> None:
        """key, value [b, s, h, d] of the batch's tokens -> their places in the pages."""
        ops.cpu_attn_reshape_and_cache(key.reshape(-1, *key.shape[2:]), value.reshape(-1, *value.shape[2:]),
                                       self.key_cache, self.value_cache, self.batch.slots, self.layer.isa)

    def attend(self, query: Tensor) -> Tensor:
        """query [b, s, h, d] -> [b, s, h, d]: each token's causal read of its request's keys and values."""
        out = torch.empty_like(query)
        batch = self.batch
        ops.cpu_attention_with_kv_cache(
            query=query.reshape(-1, *query.shape[2:]), key_cache=self.key_cache, value_cache=self.value_cache,
            output=out.view(-1, *query.shape[2:]), query_start_loc=batch.query_start, seq_lens=batch.seq_lens,
            scale=self.layer.impl.scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=batch.table,
            softcap=0.0, scheduler_metadata=batch.schedule, s_aux=None)
        return out


class OryxForCausalLM(nn.Module, HasInnerState, IsHybrid):
    """vLLM's model over the folder's ``OryxForCausalLM`` (same parameter names: ``model.*``, ``lm_head``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        core = load_core(vllm_config.model_config.model)
        self.core = core
        self.mixer_config = config.mixer_config  # built from the config's fields at each read
        self.schedule = serving_schedule(config, core.schedules)
        hf = core.model_class(config)
        self.model, self.lm_head = hf.model, hf.lm_head
        self.tied = bool(config.tie_word_embeddings)
        name = lambda kind, i: f"{prefix}{kind}.{i}".lstrip(".")  # noqa: E731
        heads, d_k, d_v = config.num_attention_heads, config.head_dim, config.value_head_dim
        self.kv = nn.ModuleList(  # None: a layer that keeps no keys and values (a layer pattern's linear layers)
            KVPages(heads, d_k, d_k ** -0.5, cache_config=vllm_config.cache_config, prefix=name("kv", i),
                    head_size_v=d_v) if keeps_kv(layer.mixer) else None for i, layer in enumerate(self.model.layers))
        largest = max(spec.page_size_bytes for spec in self.get_mamba_specs_from_config(vllm_config))
        kv_bytes = heads * (d_k + d_v) * vllm_config.model_config.dtype.itemsize if any(self.kv) else 0
        self.states = nn.ModuleList(OryxLayerState(layer.mixer, core.state.MixerCache, largest, kv_bytes,
                                                   name("states", i)) for i, layer in enumerate(self.model.layers))

    @classmethod
    def get_mamba_specs_from_config(cls, vllm_config: VllmConfig) -> List[MambaSpec]:
        """The distinct layers' state specs (vLLM sizes attention pages to hold the largest)."""
        layouts = {tuple(map(tuple, layout[1:])) for layout in folder_state_layouts(
            vllm_config.model_config.model, vllm_config.model_config.dtype)}
        return [MambaSpec(shapes=shapes, dtypes=dtypes, block_size=-1) for shapes, dtypes in layouts]

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig):
        return max(cls.get_mamba_specs_from_config(vllm_config), key=lambda spec: spec.page_size_bytes).shapes

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig):
        return max(cls.get_mamba_specs_from_config(vllm_config), key=lambda spec: spec.page_size_bytes).dtypes

    def embed_input_ids(self, input_ids: Tensor) -> Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: Tensor, positions: Tensor, intermediate_tensors=None, inputs_embeds=None,
                **kwargs) -> Tensor:
        """input_ids, positions [tokens] (this step's tokens of every request, decodes first) -> hidden [tokens,
        hidden]."""
        hidden = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
        metadata = get_forward_context().attn_metadata
        if metadata is None:  # the profiling run: no states yet
            return self.model.norm(hidden)
        # per layer, each request's (begin, end, slot): layers of different state shapes (a layer pattern's) are in
        # different vLLM cache groups, whose slots of one request differ; read once per group (its metadata)
        groups = {}
        for state in self.states:
            meta = metadata[state.prefix]
            if id(meta) not in groups:
                groups[id(meta)] = list(requests(meta))
        per_layer = [groups[id(metadata[state.prefix])] for state in self.states]
        out = torch.empty_like(hidden)
        order = per_layer[0]
        starts = positions[[begin for begin, _, _ in order]].tolist() if order else []
        # decodes: a token after earlier ones (a prompt's first token runs as a prefill, from zero states)
        decodes = [row for row, (begin, end, _) in enumerate(order) if end - begin == 1 and starts[row] > 0]
        if decodes:
            tokens = torch.tensor([order[row][0] for row in decodes], device=hidden.device)
            modes = [ROWS[row].mode_at(starts[row], self.core.schedules, self.schedule) for row in decodes]
            if len(set(modes)) == 1:  # one mixer computes
                context = self.core.context.MixerContext.build(self.mixer_config, modes[0])
            else:
                context = self.core.context.MixerContext.build(
                    self.mixer_config, torch.tensor(modes, device=hidden.device)[:, None], decode=True)
            out[tokens] = self._layers(hidden, tokens, context, per_layer, decodes, [starts[row] for row in decodes])
        chunks = {}  # prefill chunks of one start and length run as one batch: (start, length) -> rows
        for row in sorted(set(range(len(order))) - set(decodes)):
            chunks.setdefault((starts[row], order[row][1] - order[row][0]), []).append(row)
        for (start, length), rows in chunks.items():
            tokens = torch.tensor([order[row][0] for row in rows], device=hidden.device)[:, None] + torch.arange(
                length, device=hidden.device)  # [b, length]
            modes = np.stack([ROWS[row].chunk_modes(start, length, self.core.schedules, self.schedule)
                              for row in rows])
            context = self.core.context.MixerContext.build(self.mixer_config,
                                                           torch.from_numpy(modes).long().to(hidden.device))
            out[tokens] = self._layers(hidden, tokens, context, per_layer, rows, [start] * len(rows))
        return out

    def _layers(self, hidden: Tensor, tokens: Tensor, context, per_layer, rows: List[int], starts: List[int]) -> Tensor:
        """The step's requests ``rows`` through every layer, one core call per layer: a decode's token each
        (``tokens`` [b], their places in the step's ``hidden`` [tokens, hidden]) or prefill chunks of one length
        from one position (``tokens`` [b, s]; ``starts``: each request's first position of this step, on the host),
        each request in its slot (``per_layer``) and pages; ``context``: the tokens' modes (a layer pattern's
        layers read as their mixers do)."""
        positions = torch.tensor(starts, device=hidden.device)
        fresh = (positions == 0) if 0 in starts else None  # new requests: their slots' states start from zeros
        contexts = context.for_layers(self.model.layer_configs)
        metadata = get_forward_context().attn_metadata
        slots, batches = {}, {}  # per vLLM cache group (its layers share the requests' slots, or pages)
        hidden = hidden[tokens]
        for layer, layer_context, state, kv, layer_requests in zip(self.model.layers, contexts, self.states, self.kv,
                                                                   per_layer):
            if id(layer_requests) not in slots:
                slots[id(layer_requests)] = torch.tensor([layer_requests[row][2] for row in rows])
            pages = None
            if kv is not None:
                meta = metadata[kv.layer_name]
                if id(meta) not in batches:
                    batches[id(meta)] = PageBatch.of(kv, meta, rows, tokens, starts)
                batch = batches[id(meta)]
                pages = (*kv.pages(), batch.table, kv.kernels(batch))
            cache = state.batch_cache(slots[id(layer_requests)], positions, max(starts), fresh, pages)
            hidden = layer(hidden, layer_context, cache)
            state.scatter(cache, slots[id(layer_requests)])
        return self.model.norm(hidden)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[Tuple[str, Tensor]]) -> Set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.tied:
                continue
            if name not in params:
                raise ValueError(f"the folder's weight {name} is not a parameter of OryxForCausalLM")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if self.tied:
            loaded.add("lm_head.weight")
        return loaded


def requests(meta) -> Iterable[Tuple[int, int, int]]:
    """(first token, end token, state slot) of each request of the step, in the persistent batch's order: vLLM
    orders the decodes (one token each) before the prefills (``query_start_loc_p`` counts from the first prefill
    token)."""
    for i in range(meta.num_decodes):
        yield i, i + 1, int(meta.state_indices_tensor_d[i])
    if meta.num_prefills:
        starts = meta.query_start_loc_p.tolist()
        base = meta.num_decode_tokens
        for i in range(meta.num_prefills):
            yield base + starts[i], base + starts[i + 1], int(meta.state_indices_tensor_p[i])
