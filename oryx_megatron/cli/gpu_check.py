"""oryx-gpu-check: the project checked on one GPU (oryx_megatron/checks/gpu_check/; docs/gpu.md)."""

import sys

from oryx_megatron.checks.gpu_check.command import main

if __name__ == "__main__":
    sys.exit(main())
