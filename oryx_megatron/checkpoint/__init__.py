"""Checkpoint files: the layout of a run's checkpoint directory, reading a distributed checkpoint (also one
written before a parameter was renamed), and verifying one before megatron reads it. Training writes checkpoints
(``oryx_megatron.training.checkpointing``); everything that reads them reads them here."""

from oryx_megatron.checkpoint.checksums import (
    CHECKSUMS,
    ChecksumMismatch,
    file_sha256,
    verify_checksums,
    write_checksums,
)
from oryx_megatron.checkpoint.files import (
    CONFIG,
    FORMAT_VERSION,
    LATEST,
    METADATA,
    RUN_CONFIG,
    CheckpointError,
    CheckpointKeysError,
    CheckpointVersionError,
    apply_retention,
    check_retention,
    checkpoints,
    iteration_dir,
    iteration_of,
    latest_name,
    load_sharded,
    sharded_keys,
)
from oryx_megatron.checkpoint.verify import (
    latest_checkpoint,
    load_common,
    verify_checkpoint,
)

__all__ = ["CHECKSUMS", "CONFIG", "FORMAT_VERSION", "LATEST", "METADATA", "RUN_CONFIG", "CheckpointError",
           "CheckpointKeysError", "CheckpointVersionError",
           "ChecksumMismatch", "apply_retention", "check_retention", "checkpoints", "file_sha256", "iteration_dir",
           "iteration_of", "latest_checkpoint", "latest_name", "load_common", "load_sharded", "sharded_keys",
           "verify_checkpoint", "verify_checksums", "write_checksums"]
