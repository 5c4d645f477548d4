"""The folder's own code (its flat modules, as transformers' remote code loads them): the Hugging Face model
class and the sibling modules the plugin drives (``MixerContext``, ``MixerCache``, the schedules)."""

import importlib
from types import ModuleType
from typing import NamedTuple


class FolderCore(NamedTuple):
    model_class: type  # the folder's OryxForCausalLM
    context: ModuleType  # oryx_mixer_context: MixerContext
    state: ModuleType  # oryx_mixer_state: MixerCache
    schedules: ModuleType  # oryx_data_schedules: as_inference_schedule, PhaseSchedule, ...


def load_core(folder: str) -> FolderCore:
    """The core generated into ``folder`` (needs its ``modeling_oryx.py`` and siblings; no oryx-megatron)."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    model_class = get_class_from_dynamic_module("modeling_oryx.OryxForCausalLM", folder)
    package = model_class.__module__.rsplit(".", 1)[0]

    def sibling(name: str) -> ModuleType:
        return importlib.import_module(f"{package}.{name}")

    return FolderCore(model_class, sibling("oryx_mixer_context"), sibling("oryx_mixer_state"),
                      sibling("oryx_data_schedules"))
