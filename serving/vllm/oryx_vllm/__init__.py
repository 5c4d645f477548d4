"""vLLM plugin serving folders written by ``oryx-export hf`` (docs/serving.md). vLLM calls ``register`` in every
process it starts (entry point ``vllm.general_plugins``); the model's code is the folder's own, loaded at
start-up."""

import copyreg
import threading


def _fresh_rlock(lock):
    return threading.RLock, ()


def register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    from oryx_vllm.limits import OryxModelConfig

    if "OryxForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("OryxForCausalLM", "oryx_vllm.model:OryxForCausalLM")
    MODELS_CONFIG_MAP.setdefault("OryxForCausalLM", OryxModelConfig)  # start-up checks (limits.py)
    # vLLM sends the config to its engine process with the folder's modules pickled by value; on Python 3.11 a
    # functools.cached_property of theirs holds an RLock, which pickles as a new one
    copyreg.pickle(type(threading.RLock()), _fresh_rlock)
