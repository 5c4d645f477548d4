"""The console scripts, one thin module each (pyproject.toml's [project.scripts]): each parses its
arguments, calls the library and ends a bad input as one line through ``errors`` (the one error path)."""

import logging
import warnings

# megatron-core says as it is imported that Transformer Engine and apex are missing and that it falls back to
# torch: the plan on CPU (and without them on GPU: ``oryx-gpu-check`` says which kernels run), not news; unfiltered
# it puts twelve lines on stderr before a command's own, and a bad input's one line would be the thirteenth.
warnings.filterwarnings("ignore", message=r"(Transformer Engine and Apex are|Apex is) not installed",
                        category=UserWarning)
# A CUDA build of torch on a machine without a GPU (a login node; CI) logs as torch.utils.cpp_extension is imported
# that it found no CUDA runtime: that module builds C++ extensions, which no command here does.
logging.getLogger("torch.utils.cpp_extension").addFilter(
    lambda record: not record.getMessage().startswith("No CUDA runtime is found"))
