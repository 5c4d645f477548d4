"""Hugging Face transformers front end (docs/hf.md): the Oryx model as a transformers model, holding the one
mixer core (``oryx_megatron.mixer``). It imports only the core, the ops, the config and the data layer's mode
vocabulary (``data.modes``, ``data.schedules``), never megatron: an exported folder loads with torch and
transformers alone.

- ``OryxHFConfig``, ``OryxForCausalLM``, ``OryxCache``: what transformers asks of a model (config class,
  PreTrainedModel plumbing, the cache object, generate), registered here with ``AutoConfig`` /
  ``AutoModelForCausalLM`` (``model_type: "oryx"``); a folder's ``auto_map`` loads them with
  ``trust_remote_code=True`` where this package is installed;
- ``layout``: the weight names and fused-tensor splits of export and import.

Converting megatron models and configs (``interop.hf_convert``) and exporting and importing checkpoint files
is ``oryx_megatron.interop``. Needs ``transformers`` and ``safetensors``
(``pip install 'oryx-megatron[hf]'``); the rest of the package does not import this one.
"""

from transformers import AutoConfig, AutoModelForCausalLM

from oryx_megatron.hf.cache import OryxCache
from oryx_megatron.hf.configuration import MODEL_TYPE, OryxHFConfig
from oryx_megatron.hf.modeling import OryxForCausalLM

AutoConfig.register(MODEL_TYPE, OryxHFConfig, exist_ok=True)
AutoModelForCausalLM.register(OryxHFConfig, OryxForCausalLM, exist_ok=True)

__all__ = ["OryxCache", "OryxForCausalLM", "OryxHFConfig"]
