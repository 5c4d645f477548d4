"""oryx-chaos-train: kill a training run again and again and compare it with the uninterrupted run
(oryx_megatron/checks/chaos/; docs/reliability.md)."""

import sys

from oryx_megatron.checks.chaos.driver import main

if __name__ == "__main__":
    sys.exit(main())
