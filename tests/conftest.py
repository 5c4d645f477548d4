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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny ops run fastest single-threaded; oversubscribed threads slow CPU convs 30x."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
