"""Check harnesses, out of the runtime path: the GPU check's sections (``gpu_check``), the GPU session
driver (``session``), the chaos driver (``chaos``) and where a result came from (``provenance``).
Nothing under ``oryx_megatron`` but the CLI imports them."""
