"""Model recipes (the ``model`` config group under oryx_megatron/recipes/) -> megatron configs and models.

Families: ``oryx_tg`` (attention + Gated DeltaNet), ``oryx_tm`` (attention + Mamba-2),
the single-mixer baselines ``gdn`` and ``mamba2`` (the same layer with one mixer), and
``transformer`` (megatron's GPTModel with the matching local/TE spec).
"""

from dataclasses import dataclass, fields
from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from oryx_megatron.config import OryxConfig, cpu_friendly_defaults, swiglu_defaults
from oryx_megatron.layers.gpt_attention import CausalSDPAttention
from oryx_megatron.layers.norms import RMSNorm
from oryx_megatron.models.oryx_model import OryxModel
from oryx_megatron.models.specs import get_oryx_layer_spec
from oryx_megatron.models.transformer import TransformerBaseline

FAMILY_MIXERS = {
    "oryx_tg": "attention+gdn",
    "oryx_tm": "attention+mamba2",
    "gdn": "gdn",
    "mamba2": "mamba2",
    "transformer": None,
}


@dataclass
class ModelArgs:
    """Schema of a model recipe (oryx_megatron/recipes/model/*.yaml)."""

    family: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    kv_channels: Optional[int] = None  # d_k; hidden_size // heads when unset
    value_head_dim: Optional[int] = None  # d_v; d_k when unset
    ffn_hidden_size: Optional[int] = None  # 4 * hidden_size when unset (megatron's default)
    vocab_size: int = 50304  # the tokenizer's; the embedding is padded (see padded_vocab_size)
    make_vocab_size_divisible_by: int = 128
    max_sequence_length: int = 2048
    share_embeddings_and_output_weights: bool = True
    mixer_conv_kernel: int = 4
    attention_query_conv: bool = False
    shared_query: bool = False  # one query for both mixers (ablation A1)
    kv_gate: str = "none"  # multiplicative gates on the shared keys and values: none | silu | sigmoid
    linear_chunk_size: int = 64
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    transformer_impl: str = "local"  # or "transformer_engine"
    kernel_backend: str = "auto"  # "torch" | "cuda" | "auto"
    router_hidden: Optional[int] = None  # the chunk router's width (layers/router.py); None: no router
    router_chunk_size: int = 128  # tokens per router decision


def transformer_config(args: ModelArgs, **parallel) -> TransformerConfig:
    """An OryxConfig (or a TransformerConfig for ``transformer``) from a recipe.

    ``parallel`` holds TransformerConfig fields set by the run, not the recipe:
    tensor_model_parallel_size, sequence_parallel, pipeline_model_parallel_size,
    params_dtype, bf16, perform_initialization, ...
    """
    if args.family not in FAMILY_MIXERS:
        raise ValueError(f"model.family={args.family!r}: expected one of {sorted(FAMILY_MIXERS)}")
    common = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        kv_channels=args.kv_channels,
        ffn_hidden_size=args.ffn_hidden_size,
        init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        **swiglu_defaults(),
    )
    if not torch.cuda.is_available():
        common.update(cpu_friendly_defaults())
    common.update(parallel)
    if args.family == "transformer":
        return TransformerConfig(**common)
    oryx_fields = {"value_head_dim", "mixer_conv_kernel", "attention_query_conv",
                   "shared_query", "kv_gate", "linear_chunk_size", "transformer_impl", "kernel_backend",
                   "router_hidden", "router_chunk_size"}
    extra = {f.name: getattr(args, f.name) for f in fields(args) if f.name in oryx_fields}
    return OryxConfig(mixers=FAMILY_MIXERS[args.family], **common, **extra)


def padded_vocab_size(args: ModelArgs, tensor_model_parallel_size: int = 1) -> int:
    """The vocab rounded up to make_vocab_size_divisible_by, as Megatron-LM pads it.

    Unlike Megatron-LM the padding does not scale with TP, so a checkpoint keeps its
    shapes across TP sizes; the padded size must divide by the TP size.
    """
    multiple = args.make_vocab_size_divisible_by
    padded = -(-args.vocab_size // multiple) * multiple
    if padded % tensor_model_parallel_size:
        raise ValueError(
            f"model.make_vocab_size_divisible_by={multiple}: padded vocab {padded} does not "
            f"divide by tensor_model_parallel_size={tensor_model_parallel_size}"
        )
    return padded


def build_model(
    args: ModelArgs,
    config: TransformerConfig,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: Optional[int] = None,
) -> torch.nn.Module:
    """The model of this pipeline stage (and virtual pipeline stage)."""
    model_kwargs = dict(
        vocab_size=padded_vocab_size(args, config.tensor_model_parallel_size),
        max_sequence_length=args.max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=args.share_embeddings_and_output_weights,
        vp_stage=vp_stage,
    )
    if args.family == "transformer":
        return TransformerBaseline(config, _gpt_block_spec(args.transformer_impl, config, vp_stage), **model_kwargs)
    return OryxModel(config, get_oryx_layer_spec(args.transformer_impl), **model_kwargs)


def _gpt_block_spec(transformer_impl: str, config: TransformerConfig, vp_stage: Optional[int]):
    if transformer_impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    # megatron's WrappedTorchNorm refuses sequence parallelism and ignores params_dtype; ours does neither.
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    # SDPA (flash on CUDA) instead of an unfused softmax over a materialised s x s mask.
    spec.submodules.self_attention.submodules.core_attention = CausalSDPAttention
    # the block's final norm too (megatron would take WrappedTorchNorm for a layer spec)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)
