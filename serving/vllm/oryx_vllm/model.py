"""``OryxForCausalLM`` inside vLLM: the folder's own model computes (its one mixer core, every layer updating the
KV cache and the recurrent state on every token), vLLM owns the memory. Each layer's whole inference state -- the
short convs' states, each tensor of the recurrent state (``LinearMixer.state_spec``) and the layer's keys and values
for ``max_model_len`` positions -- is one vLLM "mamba" state of that layer (``OryxLayerState``), a slot per running
request: vLLM allocates it, hands each request its slot and keeps it across chunked-prefill steps and decode steps;
the plugin views the slot as the core's ``MixerCache`` of batch 1 and the core reads and writes it in place.

Every request is run through the core on its own (its tokens of this step: a prefill chunk or one decode token),
with its own schedule (``oryx_vllm.requests``: the request's ``oryx_schedule``, else the deployment's
``serving_schedule``, docs/serving.md), so requests of different schedules share a batch."""

from typing import Iterable, List, Set, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from vllm.config import VllmConfig, get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.models.interfaces import HasInnerState, IsAttentionFree
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from oryx_vllm.core import load_core
from oryx_vllm.limits import serving_schedule
from oryx_vllm.requests import ROWS


RECURRENT = "recurrent_state."  # the entries of the recurrent state's tensors: recurrent_state.<name>


def state_layout(mixer, max_len: int) -> Tuple[List[str], List[tuple], List[torch.dtype]]:
    """Names, per-slot shapes and dtypes of one layer's state, one vLLM state entry per tensor: conv_state, each
    tensor of the linear mixer's state (``recurrent_state.<name>``: ``LinearMixer.state_spec``), key, value."""
    cache = mixer.allocate_inference_cache(1, torch.get_default_dtype(), device="meta", capacity=max_len)
    entries = {"conv_state": cache.conv_state, **{RECURRENT + name: t for name, t in cache.recurrent_state.items()}}
    if cache.key is not None:  # [1, capacity, h, d] -> max_len positions
        entries.update(key=cache.key[:, :max_len], value=cache.value[:, :max_len])
    return list(entries), [tuple(t.shape[1:]) for t in entries.values()], [t.dtype for t in entries.values()]


class OryxLayerState(MambaBase, nn.Module):
    """One layer's inference state as vLLM cache memory: ``kv_cache`` holds a tensor [slots, *shape] per entry of
    ``state_layout``; ``cache(slot, start)`` is the core's MixerCache of batch 1 over that slot's views."""

    def __init__(self, mixer, max_len: int, mixer_cache_class, prefix: str):
        super().__init__()
        self.names, self.shapes, self.dtypes = state_layout(mixer, max_len)
        self.mixer_cache_class, self.prefix = mixer_cache_class, prefix
        context = get_current_vllm_config().compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        context[prefix] = self
        self.kv_cache = (torch.tensor([]),)

    def get_state_shape(self) -> Iterable[tuple]:
        return self.shapes

    def get_state_dtype(self) -> tuple:
        return tuple(self.dtypes)

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.MAMBA1  # its metadata only: slots, query starts; no kernel of it runs

    def cache(self, slot: int, start: int):
        """The MixerCache of the request in ``slot`` whose first token of this step is at position ``start``
        (0: a new request, whose slot may hold an earlier request's states: zeroed)."""
        views = {name: t[slot : slot + 1] for name, t in zip(self.names, self.kv_cache)}
        if start == 0:
            for name, view in views.items():
                if name not in ("key", "value"):
                    view.zero_()
        device = self.kv_cache[0].device
        recurrent = {name[len(RECURRENT):]: view for name, view in views.items() if name.startswith(RECURRENT)}
        return self.mixer_cache_class(views["conv_state"], views.get("key"), views.get("value"),
                                      recurrent, torch.tensor(start, device=device),
                                      torch.zeros(1, dtype=torch.long, device=device), start)


class OryxForCausalLM(nn.Module, HasInnerState, IsAttentionFree):
    """vLLM's model over the folder's ``OryxForCausalLM`` (same parameter names: ``model.*``, ``lm_head``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        core = load_core(vllm_config.model_config.model)
        self.core, self.config = core, config
        self.schedule = serving_schedule(config, core.schedules)
        hf = core.model_class(config)
        self.model, self.lm_head = hf.model, hf.lm_head
        self.tied = bool(config.tie_word_embeddings)
        max_len = vllm_config.model_config.max_model_len
        self.states = nn.ModuleList(
            OryxLayerState(layer.mixer, max_len, core.state.MixerCache, f"{prefix}states.{i}".lstrip("."))
            for i, layer in enumerate(self.model.layers))

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
        for row, (begin, end, _) in enumerate(per_layer[0]):
            start = int(positions[begin])
            modes = ROWS[row].modes(self.core.schedules, self.schedule)
            slots = [layer_requests[row][2] for layer_requests in per_layer]
            out[begin:end] = self._run(hidden[None, begin:end], slots, start, modes)[0]
        return out

    def _run(self, hidden: Tensor, slots: List[int], start: int, request_modes) -> Tensor:
        """One request's tokens of this step [1, s, hidden] through every layer with its states (in ``slots``, one per
        layer); ``request_modes``: int8 [positions] of the whole request (the last one repeated past its end)."""
        s = hidden.shape[1]
        modes = request_modes[start:start + s]
        modes = torch.from_numpy(np.pad(modes, (0, s - len(modes)), mode="edge")).long()[None]
        context = self.core.context.MixerContext.build(self.config.mixer_config, modes.to(hidden.device),
                                                       decode=start > 0 and s == 1)
        contexts = context.for_layers(self.model.layer_configs)  # a layer pattern's layers read as their mixers do
        for layer, layer_context, state, slot in zip(self.model.layers, contexts, self.states, slots):
            hidden = layer(hidden, layer_context, state.cache(slot, start))
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
