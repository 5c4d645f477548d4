"""``OryxForCausalLM``: an Oryx model (or a GDN / Mamba-2 baseline) as a transformers ``PreTrainedModel``.

    model = AutoModelForCausalLM.from_pretrained(folder)          # after `import oryx_megatron.hf`
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)  # without the import
    logits = model(ids, modes="linear").logits                    # modes: a Mode name, [b, s] per token, ...
    out = model.generate(ids, schedule="prefill=linear decode=attention", max_new_tokens=32)

The same model as megatron's ``OryxModel`` (embedding -> layers of RMSNorm, ``OryxMixer``, RMSNorm, SwiGLU
-> RMSNorm -> tied output layer), computing with the same kernels (``oryx_megatron.ops``): fp32 logits
equal megatron's within 1e-5 under every mode schedule (tests/test_hf.py).
"""

from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from oryx_megatron.config import Mode
from oryx_megatron.data.documents import document_ids as count_documents
from oryx_megatron.data.modes import parse_mode
from oryx_megatron.data.schedules import RouterSchedule, as_inference_schedule
from oryx_megatron.hf.cache import OryxCache, RoutingState
from oryx_megatron.hf.configuration import OryxHFConfig
from oryx_megatron.mixer import (
    ChunkRouter,
    HeadModule,
    HeadShard,
    MixerCache,
    MixerContext,
    OryxMixer,
)
from oryx_megatron.mixer.router import ChunkDecisions, advance_routing, allocate_router_cache, route, route_step

ModesArg = Union[None, str, int, Mode, Tensor, np.ndarray, RouterSchedule]


class OryxMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)) (megatron's fused linear_fc1 is [gate; up])."""

    def __init__(self, config: OryxHFConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OryxDecoderLayer(nn.Module):
    """h = h + mixer(norm(h)); h = h + mlp(norm(h)); the mixer is the project's one ``OryxMixer``."""

    def __init__(self, config: OryxHFConfig, index: int):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # the layer's own mixers (layer_pattern); _init_weights draws the weights
        self.mixer = OryxMixer(config.mixer_config.layer_config(index), HeadShard(initialize=False))
        self.pre_mlp_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = OryxMLP(config)

    def forward(self, hidden: Tensor, context: MixerContext, cache: Optional[MixerCache] = None) -> Tensor:
        """hidden [b, s, hidden], or [b, hidden] at a decode step; ``cache``: this layer's inference state. The call
        megatron's layer answers too, so that the routing pass (``mixer.router``) runs over either front end's
        layers."""
        hidden = hidden + self.mixer(self.input_layernorm(hidden), context, cache)
        return hidden + self.mlp(self.pre_mlp_layernorm(hidden))


class OryxPreTrainedModel(PreTrainedModel):
    config: OryxHFConfig
    config_class = OryxHFConfig
    base_model_prefix = "model"
    _no_split_modules = ["OryxDecoderLayer"]
    _keep_in_fp32_modules_strict = ["linear_mixer"]  # A_log, dt_bias, D: fp32 under bf16, as in training
    _is_stateful = True  # the recurrent state cannot be cropped: no assisted generation

    def _init_weights(self, module: nn.Module) -> None:
        """transformers' init, and the mixer's per-head parameters as training draws them (guarded: loaded
        parameters are left alone)."""
        super()._init_weights(module)
        if isinstance(module, HeadModule):
            for name in module.head_params:
                init.copy_(getattr(module, name), module.initial_value(name))

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoModelForCausalLM"):
        """A no-op: the config's ``save_pretrained`` writes the folder's code (``remote_code.model_code``)."""


class OryxModel(OryxPreTrainedModel):
    """Embedding -> Oryx layers -> final RMSNorm: hidden states [b, s, hidden]; the learned chunk router, which
    chooses the modes under a router schedule (``mixer.router``'s routing pass over the first ``router_layers``)."""

    def __init__(self, config: OryxHFConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OryxDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.layer_configs = [layer.mixer.config for layer in self.layers]  # what MixerContext.for_layers reads
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        router = config.router_config
        self.router = ChunkRouter(config.mixer_config, router) if router.hidden is not None else None
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids: Optional[Tensor] = None, modes: ModesArg = None, cache: Optional[OryxCache] = None,
                document_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None) -> Tensor:
        """input_ids [b, s] (or inputs_embeds [b, s, hidden]); ``modes`` see ``OryxForCausalLM.forward``;
        ``document_ids`` [b, s]: packed documents (derived from the EOD token when the model was trained with
        ``reset_at_eod``)."""
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = hidden.shape[:2]
        offset = 0 if cache is None else cache.seqlen
        decode = offset > 0 and s == 1
        eod = self.config.reset_at_eod_token_id
        if eod is not None and input_ids is not None:
            if cache is not None and cache.last_tokens is not None:
                cache.start_documents(cache.last_tokens == eod)  # the token after an EOD starts a document
            if document_ids is None and not decode:
                document_ids = count_documents(input_ids, eod)
        if cache is not None and cache.routing is not None:
            if modes is not None and modes != cache.routing.decisions.schedule:
                raise ValueError(f"modes={modes!r} given to a cache that routes under "
                                 f"'{cache.routing.decisions.schedule}'")
            modes = self._routed_modes(hidden, cache, offset, document_ids)
        else:
            modes = self._modes(modes, hidden, offset, document_ids)
        context = MixerContext.build(self.config.mixer_config, modes, document_ids, decode=decode)
        hidden = hidden[:, 0] if decode else hidden  # one token per sequence: the layers step on [b, hidden]
        for i, (layer, layer_context) in enumerate(zip(self.layers, context.for_layers(self.layer_configs))):
            hidden = layer(hidden, layer_context, None if cache is None else cache.layers[i])
        if cache is not None and input_ids is not None:
            cache.last_tokens = input_ids[:, -1]
        return self.norm(hidden[:, None] if decode else hidden)

    def routing(self, schedule: RouterSchedule, batch_size: int, device, cached: bool = True) -> RoutingState:
        """The routing state of ``schedule`` for ``batch_size`` sequences (``cached``: of a cache, with the
        all-linear pass's own caches where the router reads more than one layer)."""
        decisions = ChunkDecisions(self.router, schedule, self.config.router_config.chunk_size, batch_size, device)
        dtype = self.embed_tokens.weight.dtype
        return RoutingState(decisions, allocate_router_cache(self._routed_layers(), batch_size, dtype, device)
                            if cached else None)

    def _routed_layers(self):
        return self.layers[: self.config.router_config.layers]

    def _routed_modes(self, hidden: Tensor, cache: OryxCache, offset: int, document_ids: Optional[Tensor]) -> Tensor:
        """The modes [b, s] of the fed tokens (hidden [b, s, hidden], embedded) under the cache's router schedule,
        as oryx-generate decides them: the prompt's chunks from one routing pass over it, each later chunk at its
        first token, before that token's step (``route_step``); every token advances a deeper router's pass."""
        routing, layers, s = cache.routing, self._routed_layers(), hidden.shape[1]
        chunk = routing.decisions.chunk_size
        if offset == 0:
            routing.decide(route(layers, self.router, hidden, chunk, document_ids, routing.router_cache))
        elif s != 1:
            raise ValueError(f"a cache that routes continues one token at a time (generate's decoding); got {s}")
        elif offset % chunk == 0 and offset // chunk == routing.decisions.decided:
            routing.decide(route_step(layers, self.router, hidden[:, 0], cache.layers[0], routing.router_cache))
        elif routing.router_cache is not None:
            advance_routing(layers, hidden[:, 0], routing.router_cache)
        return routing.modes(offset, offset + s)

    def _modes(self, modes: ModesArg, hidden: Tensor, offset: int, document_ids: Optional[Tensor]
               ) -> Union[None, Mode, Tensor]:
        """``modes`` as a Mode or [b, s] for the fed tokens (hidden [b, s, hidden], embedded): None ->
        ``config.default_mode``; a mode name or Mode -> every token; a schedule text -> its modes of the fed
        positions [offset, offset + s) as one prompt (a router schedule: one routing pass over them, from position
        0); [s] or [b, s] -> per token. A single-mixer model reads its one mixer whatever ``modes`` says (as
        megatron's)."""
        if not self.config.is_multi_mixer:
            return None
        (b, s), device = hidden.shape[:2], hidden.device
        modes = self.config.default_mode if modes is None else modes
        if isinstance(modes, str):
            try:
                modes = parse_mode(modes, "modes")
            except ValueError:
                modes = as_inference_schedule(modes)
                if not isinstance(modes, RouterSchedule):
                    modes = modes.position_modes(offset + s, offset + s)[offset:]
        if isinstance(modes, RouterSchedule):
            if offset:
                raise ValueError(f"modes='{modes}' over a cache: pass the router schedule to generate()")
            routing = self.routing(modes, b, device, cached=False)
            routing.decide(route(self._routed_layers(), self.router, hidden, routing.decisions.chunk_size,
                                 document_ids))
            return routing.modes(0, s)
        if isinstance(modes, (int, np.integer, Mode)):
            return parse_mode(int(modes), "modes")
        modes = torch.as_tensor(modes, device=device).long()
        modes = modes.expand(b, s) if modes.dim() == 1 else modes
        if modes.shape != (b, s):
            raise ValueError(f"modes has shape {tuple(modes.shape)}; expected [batch, seq] = [{b}, {s}] or [{s}]")
        for m in torch.unique(modes).tolist():
            parse_mode(int(m), "modes")  # unknown values name themselves
        return modes


def padded_documents(mask: Tensor, offset: int, input_ids: Optional[Tensor], eod: Optional[int]) -> Tensor:
    """document_ids [b, s] of fed tokens whose ``mask`` [b, s] (0: padding) pads each row on the left: the padding
    one document, each row's first token the start of the next (and, with ``eod``, the token after each EOD one),
    so that no state, conv or attention read carries anything of the padding into the row. Only a prompt
    (``offset`` 0) is padded; ValueError for padding on the right or inside a row."""
    mask = mask.bool()
    if offset:
        raise ValueError(f"attention_mask pads tokens fed after position {offset}: only a prompt is padded (left)")
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("attention_mask pads on the right or inside a row: an Oryx model takes left padding "
                         "(tokenizer.padding_side = 'left')")
    if not bool(mask[:, -1].all()):
        raise ValueError("attention_mask has a row of padding only")
    starts = mask & ~F.pad(mask[:, :-1], (1, 0))  # the first token of each row  [b, s]
    if eod is not None and input_ids is not None:
        starts |= mask & F.pad(input_ids[:, :-1] == eod, (1, 0))
    return starts.cumsum(dim=1, dtype=torch.int32)


@dataclass
class OryxCausalLMOutput(ModelOutput):
    """loss (given labels), logits [b, s, vocab] (the last ``logits_to_keep`` positions), the cache."""

    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    cache: Optional[OryxCache] = None

    @property
    def past_key_values(self) -> Optional[OryxCache]:
        return self.cache


class OryxForCausalLM(OryxPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: OryxHFConfig):
        super().__init__(config)
        self.model = OryxModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()
        self.generation_config.use_cache = True  # generate keeps an OryxCache; a plain forward keeps none

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def allocate_cache(self, batch_size: int, kv_cache: bool = True) -> OryxCache:
        """An empty cache for ``batch_size`` sequences in the model's dtype and device (``kv_cache=False``:
        none of keys and values, for linear-only inference)."""
        weight = self.model.embed_tokens.weight
        return OryxCache([layer.mixer.allocate_inference_cache(batch_size, weight.dtype, weight.device,
                                                               kv_cache=kv_cache) for layer in self.model.layers])

    def forward(self, input_ids: Optional[Tensor] = None, modes: ModesArg = None,
                past_key_values: Optional[OryxCache] = None, use_cache: Optional[bool] = None,
                labels: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                document_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                logits_to_keep: int = 0, cache: Optional[OryxCache] = None, **kwargs) -> OryxCausalLMOutput:
        """input_ids [b, s]. ``modes``: what each token reads: None (``config.default_mode``), ``"attention"``
        / ``"linear"`` (a Mode), [b, s] or [s] per token (0 linear, 1 attention), or a schedule text of the
        project's vocabulary (``"all_linear"``, ``"random_chunks chunk_size=64"``: the fed tokens as one
        prompt). ``past_key_values`` (or ``cache``): an ``OryxCache`` the tokens continue; ``use_cache``
        (default ``config.use_cache``, False; generate passes True) makes one when none is given. ``labels``
        [b, s]: the mean next-token loss (shifted inside). ``attention_mask`` [b, total] (0: padding): left
        padding of the prompt, which the model reads as a document of its own before each row's first token
        (``padded_documents``), so that every row continues as it would alone."""
        cache = cache if cache is not None else past_key_values
        fed = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if attention_mask is not None and not bool(attention_mask[:, -fed:].bool().all()):
            if document_ids is not None:
                raise ValueError("attention_mask with padding and document_ids: give one of them")
            document_ids = padded_documents(attention_mask[:, -fed:], cache.seqlen if isinstance(cache, OryxCache)
                                            else 0, input_ids, self.config.reset_at_eod_token_id)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        b = (input_ids if input_ids is not None else inputs_embeds).shape[0]
        if cache is not None and not isinstance(cache, OryxCache):
            if cache.get_seq_length() > 0:
                raise TypeError(f"past_key_values is a {type(cache).__name__} holding tokens; "
                                "OryxForCausalLM continues only an OryxCache")
            cache = None
        if cache is None and use_cache:
            cache = self.allocate_cache(b)
            if isinstance(modes, RouterSchedule):  # generate's: the cache routes as the tokens come
                cache.routing = self.model.routing(modes, b, self.model.embed_tokens.weight.device)
        hidden = self.model(input_ids, modes, cache, document_ids, inputs_embeds)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        return OryxCausalLMOutput(loss, logits, cache)

    # ---- generation ----
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own OryxCache

    def generate(self, inputs: Optional[Tensor] = None, schedule=None, **kwargs):
        """transformers' ``generate`` with ``schedule``: the mode of every fed position, in the project's
        vocabulary (``oryx_megatron.data.schedules``: ``"all_linear"``, ``"prefill=linear
        decode=attention"``, ``"linear:0-100,attention:100-"``, ...), the prompt being ``inputs``, or the model's
        router (``"router budget=0.1"``, ``"router threshold=0.5"``: oryx-generate's decisions, the prompt's
        chunks at once and each later one at its first token); default: every token reads ``config.default_mode``.
        A model trained with ``reset_at_eod`` restarts its states after each EOD token, of the prompt or generated.
        A left-padded batch (``attention_mask``): each row's schedule counts from its first token."""
        schedule = None if schedule is None else as_inference_schedule(schedule)
        if isinstance(schedule, RouterSchedule):  # the cache it makes routes (``forward``)
            mask = kwargs.get("attention_mask")
            if mask is not None and not bool(mask.bool().all()):
                raise ValueError(f"schedule '{schedule}' with a padded batch (attention_mask): the router's chunks "
                                 f"start at each row's first token; generate the rows one at a time")
            kwargs["modes"] = schedule
        elif schedule is not None:
            ids = inputs if inputs is not None else kwargs["input_ids"]
            config = kwargs.get("generation_config") or self.generation_config
            new = kwargs.get("max_new_tokens", config.max_new_tokens)
            if new is None:
                new = kwargs.get("max_length", config.max_length) - ids.shape[1]
            mask = kwargs.get("attention_mask")
            lengths = [ids.shape[1]] * ids.shape[0] if mask is None else mask.sum(dim=1).tolist()
            kwargs["modes"] = torch.stack([  # each row's schedule from its own first token (left padding: before it)
                F.pad(torch.from_numpy(schedule.position_modes(n, n + max(new, 1) - 1)), (ids.shape[1] - n, 0),
                      value=int(parse_mode(self.config.default_mode, "default_mode"))) for n in lengths]).to(ids.device)
        return super().generate(inputs, **kwargs)

    def prepare_inputs_for_generation(self, input_ids: Tensor, cache: Optional[OryxCache] = None,
                                      past_key_values: Optional[OryxCache] = None, modes: Optional[Tensor] = None,
                                      use_cache: Optional[bool] = None, attention_mask: Optional[Tensor] = None,
                                      **kwargs) -> dict:
        """The tokens the cache has not absorbed yet (all of them without a cache) and their modes (``modes``
        [b, positions] of ``generate``'s schedule, its last mode repeated past its end)."""
        cache = cache if cache is not None else past_key_values
        start = 0 if not isinstance(cache, OryxCache) else cache.seqlen
        inputs = {"input_ids": input_ids[:, start:], "cache": cache, "use_cache": use_cache,
                  "attention_mask": attention_mask}
        if isinstance(modes, RouterSchedule):
            inputs["modes"] = modes
        elif modes is not None:
            end = input_ids.shape[1]
            if modes.shape[1] < end:
                modes = torch.cat([modes, modes[:, -1:].expand(-1, end - modes.shape[1])], dim=1)
            inputs["modes"] = modes[:, start:end]
        return inputs
