"""python -m oryx_megatron.checks.session: the GPU session (docs/gpu.md, "The call")."""

import sys

from oryx_megatron.checks.session.driver import main

sys.exit(main())
