"""Megatron models <-> Hugging Face configs and weights (in memory; ``hf_export`` and ``hf_import`` do the files).

- Oryx families (``oryx_tg``, ``oryx_tm``) and the single-mixer baselines (``gdn``, ``mamba2``) become an
  ``OryxHFConfig`` and ``OryxForCausalLM`` weights; the Transformer baseline becomes a stock
  ``LlamaConfig`` / ``LlamaForCausalLM`` (rotate-half RoPE of base 10000, SwiGLU, RMSNorm, as megatron's
  GPTModel): it loads in transformers with no remote code.
- ``model_args`` reads a recipe (``ModelArgs``) back from either config, ``router_args`` the router's architecture
  (the run's ``router.hidden``, ...); what a recipe cannot express is an error naming the field.

Metadata ``oryx`` (both configs): the format version, the family, the recipe fields a Hugging Face config
has no place for (the tokenizer's vocab, the padding multiple, transformer_impl), and the run's config
without its model, layout and paths (import writes a checkpoint of that run).
"""

from typing import Dict, Optional, Tuple

import torch
from omegaconf import OmegaConf
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from oryx_megatron.config import FAMILY_MIXERS, MIXER_FIELDS, ModelArgs
from oryx_megatron.data.modes import build_mode_schedule
from oryx_megatron.hf.configuration import FORMAT_VERSION, ROUTER_NAMES, OryxHFConfig, hf_name
from oryx_megatron.hf.layout import LLAMA_RULES, oryx_rules, to_hf, to_megatron
from oryx_megatron.hf.modeling import OryxForCausalLM
from oryx_megatron.models.builder import padded_vocab_size, transformer_config
from oryx_megatron.run_config import TrainConfig

LLAMA = "llama"
TRANSFORMER = "transformer"
ROPE_THETA = 10000.0  # megatron GPTModel's rotary_base, which TransformerBaseline keeps
METADATA_MODEL_FIELDS = ("vocab_size", "make_vocab_size_divisible_by", "transformer_impl")
RUN_SECTIONS_NOT_EXPORTED = ("model", "parallel")  # the model is the config's; the layout is import's choice
RUN_PATHS = ("checkpoint.dir", "logging.output_dir")  # the original run's places, not the model's


class ConversionError(ValueError):
    """A config or weights that cannot be converted; the message names the field or tensor."""


def hf_config(args: ModelArgs, run: Optional[TrainConfig] = None, eod_id: Optional[int] = None,
              iteration: Optional[int] = None, heldout: Optional[Dict[str, float]] = None):
    """The Hugging Face config of a recipe (an ``OryxHFConfig``, or a ``LlamaConfig`` for the Transformer):
    ``eod_id`` is the tokenizer's EOD token (bos, eos and pad; with ``run.data.reset_at_eod`` also where the
    states restart); the router is ``run.router``'s (without a run: the recipe's aliases); ``run``, ``iteration``,
    ``heldout`` (held-out loss per schedule) become metadata."""
    # the recipe with every default filled in, as training builds it
    config = transformer_config(args, None if run is None else run.router)
    tokens = dict(bos_token_id=eod_id, eos_token_id=eod_id, pad_token_id=eod_id)
    common = dict(vocab_size=padded_vocab_size(args), hidden_size=config.hidden_size,
                  intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
                  num_attention_heads=config.num_attention_heads, head_dim=config.kv_channels,
                  rms_norm_eps=config.layernorm_epsilon, max_position_embeddings=args.max_sequence_length,
                  initializer_range=config.init_method_std,
                  tie_word_embeddings=args.share_embeddings_and_output_weights, **tokens)
    metadata = _metadata(args, run, iteration, heldout)
    if args.family == TRANSFORMER:
        return LlamaConfig(num_key_value_heads=config.num_query_groups or config.num_attention_heads,
                           rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, hidden_act="silu",
                           attention_bias=False, mlp_bias=False, oryx=metadata, **common)
    reset = run is not None and run.data.reset_at_eod
    if reset and eod_id is None:
        raise ConversionError("data.reset_at_eod is true but no EOD token is known: the tokenizer is needed")
    mixer = {hf_name(name): value for name, value in config.mixer_fields().items()}
    router = {name: getattr(config.router, key) for key, name in ROUTER_NAMES.items()}
    return OryxHFConfig(
        **{**common, **mixer, **router}, default_mode="attention" if config.has_attention else "linear",
        reset_at_eod_token_id=eod_id if reset else None,
        training_mode_schedule=None if run is None else _schedule_text(run.data.mode_schedule), oryx=metadata)


def _metadata(args: ModelArgs, run: Optional[TrainConfig], iteration: Optional[int],
              heldout: Optional[Dict[str, float]]) -> dict:
    metadata = {"format_version": FORMAT_VERSION, "family": args.family,
                "model": {name: getattr(args, name) for name in METADATA_MODEL_FIELDS}}
    if run is not None:
        sections = OmegaConf.to_container(OmegaConf.structured(run))
        for path in RUN_PATHS:
            section, key = path.split(".")
            sections[section][key] = None
        metadata["run"] = {k: v for k, v in sections.items() if k not in RUN_SECTIONS_NOT_EXPORTED}
    if iteration is not None:
        metadata["iteration"] = iteration
        if run is not None:
            metadata["tokens_trained"] = iteration * run.train.global_batch_size * run.data.seq_length
    if heldout:
        metadata["heldout_loss"] = dict(heldout)
    return metadata


def _schedule_text(schedule: dict) -> str:
    """data.mode_schedule as the text form of ``build_mode_schedule``."""
    return str(build_mode_schedule(dict(schedule)))


def model_args(config) -> ModelArgs:
    """The recipe of a Hugging Face config (``OryxHFConfig`` or ``LlamaConfig``)."""
    model = dict(config.oryx.get("model", {})) if isinstance(getattr(config, "oryx", None), dict) else {}
    common = dict(num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
                  num_attention_heads=config.num_attention_heads, kv_channels=config.head_dim,
                  ffn_hidden_size=config.intermediate_size, max_sequence_length=config.max_position_embeddings,
                  share_embeddings_and_output_weights=config.tie_word_embeddings,
                  init_method_std=config.initializer_range, layernorm_epsilon=config.rms_norm_eps,
                  vocab_size=model.get("vocab_size", config.vocab_size),
                  make_vocab_size_divisible_by=model.get("make_vocab_size_divisible_by", 1),
                  transformer_impl=model.get("transformer_impl", "local"))
    if config.model_type == LLAMA:
        _require_llama_fields(config)
        args = ModelArgs(family=TRANSFORMER, **common)
    else:
        family = {mixers: name for name, mixers in FAMILY_MIXERS.items() if mixers}.get(config.mixers, "oryx")
        mixer = {name: getattr(config, hf_name(name)) for name in MIXER_FIELDS}
        args = ModelArgs(family=family, **{**mixer, **common})
    if padded_vocab_size(args) != config.vocab_size:
        raise ConversionError(
            f"vocab_size={config.vocab_size} does not match the recipe's padded vocab {padded_vocab_size(args)} "
            f"(model.vocab_size={args.vocab_size}, make_vocab_size_divisible_by={args.make_vocab_size_divisible_by} "
            f"in oryx.model): the embedding was resized after export")
    return args


def router_args(config) -> Dict[str, Optional[int]]:
    """The router's architecture in a Hugging Face config, as the run's ``router`` keys (hidden, chunk_size, layers;
    none in a ``LlamaConfig``)."""
    return {} if config.model_type == LLAMA else {key: getattr(config, name) for key, name in ROUTER_NAMES.items()}


def _require(config, field: str, value) -> None:
    if getattr(config, field) != value:
        raise ConversionError(f"{field}={getattr(config, field)!r}: a megatron recipe supports only {value!r}")


def _require_llama_fields(config: LlamaConfig) -> None:
    if config.num_key_value_heads != config.num_attention_heads:
        raise ConversionError(f"num_key_value_heads={config.num_key_value_heads}: the Transformer recipe has no "
                              f"grouped-query attention (num_attention_heads={config.num_attention_heads})")
    rope = dict(config.rope_parameters or {})
    if rope.get("rope_type", "default") != "default" or float(rope.get("rope_theta", ROPE_THETA)) != ROPE_THETA:
        raise ConversionError(f"rope_parameters={rope}: the Transformer recipe has default RoPE of base {ROPE_THETA:g}")
    for field, value in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        _require(config, field, value)


def rules_of(config) -> Tuple:
    return LLAMA_RULES if config.model_type == LLAMA else oryx_rules(config)


def megatron_to_hf(state: Dict[str, Tensor], config) -> Dict[str, Tensor]:
    """A TP = PP = 1 megatron state dict -> Hugging Face weights (tied: ``lm_head.weight`` is the embedding)."""
    weights = to_hf(state, rules_of(config), config)
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def hf_to_megatron(weights: Dict[str, Tensor], config) -> Dict[str, Tensor]:
    """Hugging Face weights -> a megatron state dict (without megatron's ``_extra_state`` entries)."""
    if config.tie_word_embeddings:
        weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
    return to_megatron(weights, rules_of(config), config)


def hf_model(config, weights: Dict[str, Tensor], dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The Hugging Face model of ``config`` holding ``weights``, in ``dtype`` (the SSM scalars stay fp32)."""
    cls = LlamaForCausalLM if config.model_type == LLAMA else OryxForCausalLM
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as from_pretrained builds a model in its dtype
    try:
        model = cls(config)
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ConversionError(f"weights do not fit the {cls.__name__} of the config: missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(unexpected)[:3]}")
    return model.eval()
