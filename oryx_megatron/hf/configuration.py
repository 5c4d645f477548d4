"""``OryxHFConfig``: the transformers config of an Oryx model (``model_type: "oryx"``).

Every field the model's math needs is a field here (megatron's ``OryxConfig`` under the names
transformers users know: ``head_dim`` is d_k, ``intermediate_size`` the MLP width, ...), so that an
exported folder loads with nothing but this package. What describes the training run and not the
model (the run config, the training mode schedule, the iteration) is metadata in ``oryx``: import
reads it back; the model ignores it.

New model parts (the learned router of issue #23, ...) are new fields with a default that means
"absent" and new weight names (``layout.py``): folders written before them keep loading.
"""

import os
from pathlib import Path
from typing import Optional, Union

from transformers import PretrainedConfig

MODEL_TYPE = "oryx"
FORMAT_VERSION = 1  # of the folder layout; a change that old readers cannot load raises it
KV_GATES = ("none", "silu", "sigmoid")
MODE_NAMES = ("attention", "linear")
LINEAR_MIXERS = ("gdn", "mamba2")

# trust_remote_code=True: the two modules a folder carries, which re-export the installed package's classes.
AUTO_MAP = {"AutoConfig": "configuration_oryx.OryxHFConfig", "AutoModelForCausalLM": "modeling_oryx.OryxForCausalLM"}
REMOTE_CODE = {
    "configuration_oryx.py": ("OryxHFConfig", "oryx_megatron.hf.configuration", "config"),
    "modeling_oryx.py": ("OryxForCausalLM", "oryx_megatron.hf.modeling", "model"),
}


def write_remote_code(folder: Union[str, os.PathLike]) -> None:
    """The modules that ``auto_map`` names, into ``folder``: each re-exports a class of the installed package."""
    for file, (name, module, what) in REMOTE_CODE.items():
        (Path(folder) / file).write_text(
            f'"""Oryx (trust_remote_code=True): the {what} class of the installed oryx-megatron '
            f'(pip install \'oryx-megatron[hf]\')."""\n\nfrom {module} import {name}  # noqa: F401\n')


class OryxHFConfig(PretrainedConfig):
    """An Oryx multi-mixer model (``mixers="attention+gdn"``: Oryx-TG, ``"attention+mamba2"``: Oryx-TM) or
    a single-mixer baseline (``"gdn"``, ``"mamba2"``); field meanings as in ``oryx_megatron.config.OryxConfig``
    and docs/model.md."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 50304,  # embedding rows: the tokenizer's vocab padded (the padded ids are never sampled)
        hidden_size: int = 768,
        intermediate_size: int = 2048,  # SwiGLU width
        num_hidden_layers: int = 12,
        num_attention_heads: int = 12,  # H, shared by both mixers
        head_dim: int = 64,  # d_k: keys and both queries
        value_head_dim: Optional[int] = None,  # d_v; head_dim when None
        mixers: str = "attention+gdn",
        conv_kernel: int = 4,  # the short convs' width
        conv_activation: Optional[str] = "silu",
        attention_query_conv: bool = False,
        shared_query: bool = False,
        kv_gate: str = "none",
        attention_rotary: bool = True,
        rope_theta: float = 10000.0,
        linear_chunk_size: int = 64,
        rms_norm_eps: float = 1e-5,
        max_position_embeddings: int = 2048,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        default_mode: str = "attention",  # what a token reads when no modes are given (multi-mixer models)
        reset_at_eod_token_id: Optional[int] = None,  # trained with data.reset_at_eod: states restart after it
        kernel_backend: str = "auto",  # oryx_megatron.ops.get_kernels: "auto" | "torch" | "cuda"
        router_hidden: Optional[int] = None,  # the learned chunk router's width (docs/routing.md); None: none
        router_chunk_size: int = 128,  # tokens per router decision
        training_mode_schedule: Optional[str] = None,  # metadata: data.mode_schedule of the run
        oryx: Optional[dict] = None,  # metadata: format_version, family, the run config, iteration, ...
        bos_token_id: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        pad_token_id: Optional[int] = None,
        use_cache: bool = False,  # forward keeps no state unless asked; generate asks (generation_config)
        **kwargs,
    ):
        kwargs.setdefault("auto_map", dict(AUTO_MAP))
        super().__init__(**kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.value_head_dim = head_dim if value_head_dim is None else value_head_dim
        self.mixers = mixers
        self.conv_kernel = conv_kernel
        self.conv_activation = conv_activation
        self.attention_query_conv = attention_query_conv
        self.shared_query = shared_query
        self.kv_gate = kv_gate
        self.attention_rotary = attention_rotary
        self.rope_theta = rope_theta
        self.linear_chunk_size = linear_chunk_size
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.tie_word_embeddings = tie_word_embeddings
        self.default_mode = default_mode
        self.reset_at_eod_token_id = reset_at_eod_token_id
        self.kernel_backend = kernel_backend
        self.router_hidden, self.router_chunk_size = router_hidden, router_chunk_size
        self.training_mode_schedule = training_mode_schedule
        self.oryx = {"format_version": FORMAT_VERSION} if oryx is None else dict(oryx)
        self.bos_token_id, self.eos_token_id, self.pad_token_id = bos_token_id, eos_token_id, pad_token_id
        self.use_cache = use_cache
        self._check()

    def _check(self) -> None:
        mixers = self.mixer_list
        known = all(m in ("attention",) + LINEAR_MIXERS for m in mixers)
        if not known or len(set(mixers)) != len(mixers) or sum(m in LINEAR_MIXERS for m in mixers) != 1:
            raise ValueError(f"OryxHFConfig.mixers={self.mixers!r}: expected 'attention+gdn', 'attention+mamba2', "
                             f"'gdn' or 'mamba2'")
        if self.kv_gate not in KV_GATES:
            raise ValueError(f"OryxHFConfig.kv_gate={self.kv_gate!r}: expected one of {KV_GATES}")
        if self.default_mode not in MODE_NAMES:
            raise ValueError(f"OryxHFConfig.default_mode={self.default_mode!r}: expected one of {MODE_NAMES}")
        if self.shared_query and not self.has_attention:
            raise ValueError(f"OryxHFConfig.shared_query=True needs attention among mixers={self.mixers!r}")
        version = self.oryx.get("format_version", FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise ValueError(f"OryxHFConfig.oryx.format_version={version}: written by a newer oryx-megatron "
                             f"(this one reads {FORMAT_VERSION}); upgrade the package")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' ``save_pretrained`` (which a model's ``save_pretrained`` calls), and the modules that
        ``auto_map`` names."""
        super().save_pretrained(save_directory, *args, **kwargs)
        write_remote_code(save_directory)

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoConfig"):
        """A no-op: ``auto_map`` names the re-exporting modules (``write_remote_code``); transformers must not
        copy this package's source files into a saved folder."""

    @property
    def mixer_list(self):
        return tuple(m.strip() for m in self.mixers.split("+") if m.strip())

    @property
    def has_attention(self) -> bool:
        return "attention" in self.mixer_list

    @property
    def linear_mixer(self) -> str:
        """'gdn' or 'mamba2'."""
        return next(m for m in self.mixer_list if m in LINEAR_MIXERS)

    @property
    def is_multi_mixer(self) -> bool:
        return len(self.mixer_list) > 1
