"""Model recipes (the ``model`` config group under recipes/) -> megatron configs and models.

Families: ``oryx_tg`` (attention + Gated DeltaNet), ``oryx_tm`` (attention + Mamba-2),
the single-mixer baselines ``gdn`` and ``mamba2`` (the same layer with one mixer), and
``transformer`` (megatron's GPTModel with the matching local/TE spec).
"""

from typing import Optional

import torch
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from oryx_megatron.compat.megatron import mlp_submodules
from oryx_megatron.config import ModelArgs, RouterConfig
from oryx_megatron.config.pattern import pipeline_segments
from oryx_megatron.config.router import model_router
from oryx_megatron.layers.config import (
    OryxConfig,
    cpu_friendly_defaults,
    swiglu_defaults,
)
from oryx_megatron.layers.gpt_attention import CausalSDPAttention
from oryx_megatron.layers.linear import ColumnLinear, RowLinear
from oryx_megatron.layers.norms import RMSNorm
from oryx_megatron.models.oryx_model import OryxModel
from oryx_megatron.models.specs import get_oryx_layer_spec
from oryx_megatron.models.transformer import LayerSeededTransformerLayer, TransformerBaseline


def transformer_config(args: ModelArgs, router: Optional[RouterConfig] = None, **parallel) -> TransformerConfig:
    """An OryxConfig (or a TransformerConfig for ``transformer``) from a recipe: every MixerConfig field of the
    recipe, the model's shape, the SwiGLU layer's defaults, and its router: ``router`` (a run's ``router`` group;
    None: the recipe's aliases, ``config.router.model_router``).

    ``parallel`` holds TransformerConfig fields set by the run, not the recipe:
    tensor_model_parallel_size, sequence_parallel, pipeline_model_parallel_size,
    params_dtype, bf16, perform_initialization, ...
    """
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
    common.update(_pipeline_layout(args, common))
    router = model_router(args, router)
    if args.is_transformer:
        return TransformerConfig(**common)
    return OryxConfig(**{**args.mixer_fields(), **common}, router=router, transformer_impl=args.transformer_impl)


def _pipeline_layout(args: ModelArgs, config: dict) -> dict:
    """megatron's ``pipeline_model_parallel_layout`` (embedding, each stage's decoder layers, loss) where the layer
    pattern splits the layers at ``|`` (``config.pattern.pipeline_segments``); nothing where megatron splits them
    evenly."""
    stages = config.get("pipeline_model_parallel_size", 1) * (config.get("virtual_pipeline_model_parallel_size") or 1)
    segments = None if args.layer_pattern is None else pipeline_segments(args.layer_pattern, stages)
    if segments is None:
        return {}
    layout = [["decoder"] * n for n in segments]
    layout[0].insert(0, "embedding")
    layout[-1].append("loss")
    return {"pipeline_model_parallel_layout": layout}


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
    if args.is_transformer:
        return TransformerBaseline(config, _gpt_block_spec(args.transformer_impl, config, vp_stage), **model_kwargs)
    return OryxModel(config, get_oryx_layer_spec(args.transformer_impl), **model_kwargs)


def _gpt_block_spec(transformer_impl: str, config: TransformerConfig, vp_stage: Optional[int]):
    if transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec()
        spec.module = LayerSeededTransformerLayer
        return spec
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    spec.module = LayerSeededTransformerLayer  # the same initial weights at any pipeline layout
    # megatron's WrappedTorchNorm refuses sequence parallelism and ignores params_dtype; ours does neither.
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    # SDPA (flash on CUDA) instead of an unfused softmax over a materialised s x s mask.
    spec.submodules.self_attention.submodules.core_attention = CausalSDPAttention
    # plain F.linear at TP=1 without autograd (layers/linear.py)
    attention, mlp = spec.submodules.self_attention.submodules, mlp_submodules(spec)
    attention.linear_qkv, attention.linear_proj = ColumnLinear, RowLinear
    mlp.linear_fc1, mlp.linear_fc2 = ColumnLinear, RowLinear
    # the block's final norm too (megatron would take WrappedTorchNorm for a layer spec)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=RMSNorm)
