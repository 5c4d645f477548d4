"""What a deployment may ask, checked at start-up: each refusal one line naming the setting (docs/serving.md)."""

import importlib
from typing import Any

from vllm.logger import init_logger
from vllm.model_executor.models.config import HybridAttentionMambaModelConfig

from oryx_vllm import OryxServingError
from oryx_vllm.requests import parse_schedule, serve

logger = init_logger("vllm.oryx_vllm")  # under vLLM's logger: its handler and level print it

SCHEDULE_KEY = "serving_schedule"  # --hf-overrides '{"serving_schedule": "prefill=linear decode=attention"}'


class OryxModelConfig(HybridAttentionMambaModelConfig):
    """vLLM's start-up hook for the architecture (in the process that builds the config, before any engine
    starts): prefix caching turned off (a layer's conv and recurrent states are one slot per request), what the
    plugin does not serve refused, then vLLM's settings of its hybrid models (vLLM sizes the KV pages to the
    states' slots once it has built the layers)."""

    @classmethod
    def verify_and_update_config(cls, vllm_config) -> None:
        if vllm_config.cache_config.enable_prefix_caching:  # vLLM's default for a hybrid model, or asked for
            logger.info("oryx-vllm: prefix caching off: each layer's conv and recurrent states are one slot per "
                        "request")
            vllm_config.cache_config.enable_prefix_caching = False
        check_deployment(vllm_config)
        check_core(vllm_config.model_config.hf_config)
        serving_schedule(vllm_config.model_config.hf_config, serve(vllm_config.model_config.hf_config))
        super().verify_and_update_config(vllm_config)


def check_deployment(vllm_config) -> None:
    """Refuse what the plugin does not serve, naming the setting."""
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise OryxServingError(f"oryx-vllm: tensor_parallel_size={parallel.tensor_parallel_size}, pipeline_parallel_"
                               f"size={parallel.pipeline_parallel_size}: one process serves the model (set both to 1)")
    if vllm_config.speculative_config is not None:
        raise OryxServingError("oryx-vllm: speculative_config is not supported")
    if vllm_config.cache_config.cache_dtype != "auto":
        raise OryxServingError(f"oryx-vllm: kv_cache_dtype={vllm_config.cache_config.cache_dtype} is not supported: "
                               "the core writes keys and values in the model's dtype (use auto)")
    if vllm_config.model_config.enable_prompt_embeds:
        raise OryxServingError("oryx-vllm: enable_prompt_embeds is not supported (a schedule counts prompt tokens)")
    config = vllm_config.model_config.hf_config
    if getattr(config, "reset_at_eod_token_id", None) is not None:
        raise OryxServingError(f"oryx-vllm: reset_at_eod_token_id={config.reset_at_eod_token_id} (packed "
                               "documents restarting at EOD) is not supported")


def check_core(config) -> None:
    """The folder's core keeps keys and values in an engine's pages, written and read by the engine's kernels
    (``MixerCache.block_table``, ``engine_kv``: 2026-12-08); an earlier export's does not."""
    state = importlib.import_module(type(config).__module__.rsplit(".", 1)[0] + ".oryx_mixer_state")
    if "engine_kv" not in getattr(state.MixerCache, "__dataclass_fields__", {}):
        raise OryxServingError("oryx-vllm: the folder's core does not let vLLM's kernels keep its keys and values "
                               "(its MixerCache has no engine_kv): export the folder again (oryx-export hf)")


def serving_schedule(config: Any, schedules) -> Any:
    """The deployment's InferenceSchedule, for requests that name none: ``config.serving_schedule`` (default: every
    token reads ``config.default_mode``)."""
    text = getattr(config, SCHEDULE_KEY, None) or f"all_{config.default_mode}"
    return parse_schedule(text, schedules, where=SCHEDULE_KEY)
