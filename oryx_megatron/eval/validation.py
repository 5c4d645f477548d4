"""Validation loss of an MQAR-trained model, the number a learning-rate sweep selects on.

The validation set is MQAR samples of the run's training distribution generated from a seed
of their own (``generate_mqar`` with ``seed``): neither the training stream (per-sample seeds
derived from (train.seed, split, index)) nor the test set of ``evaluate_retrieval`` (its own
``seed``). The loss is the mean cross entropy on the answer tokens, each token read with the
run's training mode schedule.
"""

import numpy as np
import torch

from oryx_megatron.data.modes import build_mode_schedule
from oryx_megatron.eval.retrieval import build_task
from oryx_megatron.run_config import TrainConfig


def validation_samples(run: TrainConfig, seed: int, num_samples: int) -> dict:
    """``num_samples`` MQAR samples (``generate_mqar``'s dict) of the run's task, drawn with ``seed``."""
    if run.data.format != "mqar":
        raise ValueError(f"the validation split is generated MQAR; this run trained on data.format={run.data.format}")
    d = run.data
    sample, _, _ = build_task("mqar", run, num_samples, d.seq_length, seed, "random", d.mqar_num_pairs,
                              d.mqar_num_queries, 1, 1, 1)
    return sample


@torch.no_grad()
def validation_loss(model, run: TrainConfig, seed: int, num_samples: int = 256, batch_size: int = 32) -> float:
    """Mean loss on the answer tokens of ``validation_samples`` under the training mode schedule."""
    sample = validation_samples(run, seed, num_samples)
    inputs, labels, mask = (torch.from_numpy(np.ascontiguousarray(sample[key])) for key in ("inputs", "labels", "answer_mask"))
    modes = build_mode_schedule(run.data.mode_schedule).batch(inputs.shape[1], range(num_samples))
    device = next(model.parameters()).device
    total = 0.0
    for i in range(0, num_samples, batch_size):
        part = slice(i, i + batch_size)
        loss = model(inputs[part].to(device), modes[part].to(device), labels=labels[part].to(device)).float().cpu()
        total += float(loss[mask[part]].sum())
    return total / float(mask.sum())
