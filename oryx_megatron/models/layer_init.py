"""Initial weights that depend only on the seed and a layer's global number, so that every pipeline layout
(which layers a stage builds, in which order) starts from the same model."""

from contextlib import contextmanager

import torch


@contextmanager
def layer_init_rng(global_layer_number: int):
    """The CPU generator seeded with the run's seed + ``global_layer_number`` (1-based) inside; as before after."""
    seed = torch.initial_seed() + global_layer_number
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
