import os
import warnings

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def single_process_parallel():
    """A world of one with megatron's parallel state (TP = PP = 1)."""
    from oryx_megatron.parallel import initialize_parallel

    initialize_parallel()
