"""Hugging Face transformers interop (docs/hf.md): the Oryx model as a transformers model, and the
conversion of megatron checkpoints to transformers folders and back.

- ``OryxHFConfig``, ``OryxForCausalLM``, ``OryxCache``: the model (plain torch modules computing with
  ``oryx_megatron.ops``), registered here with ``AutoConfig`` / ``AutoModelForCausalLM`` (``model_type:
  "oryx"``); a folder's ``auto_map`` loads them with ``trust_remote_code=True`` where this package is installed;
- ``layout``: the weight names and fused-tensor splits that export and import share;
- ``export`` / ``importing``: ``oryx-export hf`` and ``oryx-import hf`` (``oryx_megatron.cli``).

Needs ``transformers`` and ``safetensors`` (``pip install 'oryx-megatron[hf]'``); the rest of the package
does not import this one.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from oryx_megatron.hf.cache import OryxCache
from oryx_megatron.hf.configuration import MODEL_TYPE, OryxHFConfig
from oryx_megatron.hf.modeling import OryxForCausalLM

AutoConfig.register(MODEL_TYPE, OryxHFConfig, exist_ok=True)
AutoModelForCausalLM.register(OryxHFConfig, OryxForCausalLM, exist_ok=True)

__all__ = ["OryxCache", "OryxForCausalLM", "OryxHFConfig"]
