"""The weight layout that the Hugging Face model, export and import share.

- ``mixer_streams`` / ``conv_streams``: the per-head rows of the fused input projection ``in_proj``
  (head-major: per head k, v, g, [k_gate, v_gate], [q_attn], then the linear mixer's streams) and the
  streams with a short conv, as megatron's ``MultiMixer`` lays them out;
- ``ORYX_RULES`` / ``LLAMA_RULES``: megatron parameter name <-> Hugging Face name(s), with the split of
  a fused megatron tensor into its Hugging Face parts (SwiGLU's ``linear_fc1`` into gate and up, the
  Transformer's ``linear_qkv`` into q, k, v) and the join back.

A model part without a rule fails export and import by name: new parameters (a router, ...) are one
more rule here.
"""

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import Tensor

# Per-head widths of each linear mixer's own streams ("key": d_k) and its per-head fp32 parameters.
LINEAR_STREAMS = {"gdn": {"q_lin": "key", "beta": 1, "alpha": 1}, "mamba2": {"q_lin": "key", "dt": 1}}
LINEAR_PARAMETERS = {"gdn": ("A_log", "dt_bias"), "mamba2": ("A_log", "dt_bias", "D")}
LINEAR_CONV_STREAMS = ("q_lin",)


def mixer_streams(config) -> Dict[str, int]:
    """Stream -> per-head width of ``in_proj``'s rows, in layout order (an ``OryxHFConfig``)."""
    d_k, d_v = config.head_dim, config.value_head_dim
    streams = {"k": d_k, "v": d_v, "g": d_v}
    if config.kv_gate != "none":
        streams.update(k_gate=d_k, v_gate=d_v)
    if config.has_attention and not config.shared_query:
        streams["q_attn"] = d_k
    for name, width in LINEAR_STREAMS[config.linear_mixer].items():
        streams[name] = d_k if width == "key" else width
    return streams


def conv_streams(config) -> List[str]:
    """The streams with a short conv, in megatron's order (their parameters are ``conv_<stream>``)."""
    names = ["k", "v", *LINEAR_CONV_STREAMS]
    if "q_attn" in mixer_streams(config) and config.attention_query_conv:
        names.append("q_attn")
    return names


@dataclass(frozen=True)
class Rule:
    """One megatron parameter (``{i}``: the layer number) and the Hugging Face parameter(s) it becomes."""

    megatron: str
    hf: Tuple[str, ...]
    split: Optional[Callable[[Tensor, object], Tuple[Tensor, ...]]] = None  # fused -> parts (several hf names)
    join: Optional[Callable[[Tuple[Tensor, ...], object], Tensor]] = None

    def pattern(self, template: str) -> re.Pattern:
        return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


def _halves(weight: Tensor, config) -> Tuple[Tensor, Tensor]:
    """megatron's SwiGLU fc1 [2F, D] -> gate [F, D] (its first half, silu'd), up [F, D]."""
    gate, up = weight.chunk(2, dim=0)
    return gate.contiguous(), up.contiguous()


def _cat(parts: Tuple[Tensor, ...], config) -> Tensor:
    return torch.cat(parts, dim=0)


def _qkv_sizes(config) -> Tuple[int, int, int]:
    """(query groups, query heads per group, head dim) of a LlamaConfig."""
    groups = config.num_key_value_heads
    return groups, config.num_attention_heads // groups, config.head_dim


def _split_qkv(weight: Tensor, config) -> Tuple[Tensor, Tensor, Tensor]:
    """megatron's linear_qkv [groups * (per_group + 2) * d, D], per query group [its queries, key, value]
    -> q_proj [heads * d, D], k_proj, v_proj [groups * d, D]."""
    groups, per_group, d = _qkv_sizes(config)
    q, k, v = weight.view(groups, (per_group + 2) * d, -1).split([per_group * d, d, d], dim=1)
    return tuple(t.reshape(-1, weight.shape[-1]).contiguous() for t in (q, k, v))


def _join_qkv(parts: Tuple[Tensor, ...], config) -> Tensor:
    groups, per_group, d = _qkv_sizes(config)
    q, k, v = (t.view(groups, -1, t.shape[-1]) for t in parts)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


_EMBEDDING = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
_FINAL_NORM = Rule("decoder.final_layernorm.weight", ("model.norm.weight",))
_OUTPUT = Rule("output_layer.weight", ("lm_head.weight",))  # untied output layers only
_MLP = (
    Rule("decoder.layers.{i}.mlp.linear_fc1.weight",
         ("model.layers.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.up_proj.weight"), _halves, _cat),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", ("model.layers.{i}.mlp.down_proj.weight",)),
)

ORYX_RULES = (
    _EMBEDDING,
    Rule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
    Rule("decoder.layers.{i}.mixer.in_proj.weight", ("model.layers.{i}.mixer.in_proj.weight",)),
    *(Rule(f"decoder.layers.{{i}}.mixer.conv_{s}", (f"model.layers.{{i}}.mixer.conv_{s}.weight",))
      for s in ("k", "v", "q_lin", "q_attn")),
    Rule("decoder.layers.{i}.mixer.out_norm_weight", ("model.layers.{i}.mixer.out_norm.weight",)),
    Rule("decoder.layers.{i}.mixer.out_proj.weight", ("model.layers.{i}.mixer.out_proj.weight",)),
    *(Rule(f"decoder.layers.{{i}}.mixer.linear_mixer.{p}", (f"model.layers.{{i}}.mixer.linear_mixer.{p}",))
      for p in ("A_log", "dt_bias", "D")),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.pre_mlp_layernorm.weight",)),
    *_MLP,
    _FINAL_NORM,
    _OUTPUT,
    *(Rule(f"router.{p}", (f"model.router.{p}",))  # the chunk router (carried, docs/hf.md)
      for p in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "calibration", "price")),
)

LLAMA_RULES = (
    _EMBEDDING,
    Rule("decoder.layers.{i}.input_layernorm.weight", ("model.layers.{i}.input_layernorm.weight",)),
    Rule("decoder.layers.{i}.self_attention.linear_qkv.weight",
         tuple(f"model.layers.{{i}}.self_attn.{p}_proj.weight" for p in "qkv"), _split_qkv, _join_qkv),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", ("model.layers.{i}.self_attn.o_proj.weight",)),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", ("model.layers.{i}.post_attention_layernorm.weight",)),
    *_MLP,
    _FINAL_NORM,
    _OUTPUT,
)


class LayoutError(ValueError):
    """A parameter that the layout has no rule for, or a missing part of one (its name in the message)."""


def _match(rules, name: str, side: str) -> Tuple[Rule, Optional[str]]:
    for rule in rules:
        templates = (rule.megatron,) if side == "megatron" else rule.hf
        for template in templates:
            found = rule.pattern(template).match(name)
            if found:
                return rule, found.groupdict().get("i")
    raise LayoutError(f"{side} parameter {name!r} has no counterpart in the weight layout (oryx_megatron/hf/layout.py)")


def _fill(template: str, layer: Optional[str]) -> str:
    return template if layer is None else template.replace("{i}", layer)


def to_hf(state: Mapping[str, Tensor], rules, config) -> Dict[str, Tensor]:
    """A megatron state dict (TP = PP = 1; megatron's ``_extra_state`` entries are skipped) in Hugging
    Face names, fused tensors split (``config``: the Hugging Face config)."""
    out = {}
    for name, tensor in state.items():
        if name.endswith("_extra_state"):
            continue
        rule, layer = _match(rules, name, "megatron")
        parts = rule.split(tensor, config) if rule.split else (tensor,)
        out.update({_fill(template, layer): part for template, part in zip(rule.hf, parts)})
    return out


def to_megatron(state: Mapping[str, Tensor], rules, config) -> Dict[str, Tensor]:
    """Hugging Face weights in megatron names, split tensors joined; a missing part is a LayoutError."""
    grouped: Dict[str, Tuple[Rule, Optional[str]]] = {}
    for name in state:
        rule, layer = _match(rules, name, "hf")
        grouped[_fill(rule.megatron, layer)] = (rule, layer)
    out = {}
    for name, (rule, layer) in grouped.items():
        names = [_fill(template, layer) for template in rule.hf]
        missing = [n for n in names if n not in state]
        if missing:
            raise LayoutError(f"hf parameter {missing[0]!r} is missing (a part of megatron's {name!r})")
        parts = tuple(state[n] for n in names)
        out[name] = rule.join(parts, config) if rule.join else parts[0]
    return out
