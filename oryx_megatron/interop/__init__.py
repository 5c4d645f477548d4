"""Training checkpoints to and from other formats: ``hf_convert`` (megatron models and configs <-> transformers
ones, in memory), ``hf_export`` (``oryx-export hf``: a
checkpoint as a transformers folder) and ``hf_import`` (``oryx-import hf``: a folder as iteration 0 of a run,
at any TP layout). They read and write training checkpoints, so they sit above both ``oryx_megatron.hf`` (the
transformers model, in memory) and ``oryx_megatron.training``."""
