"""Preemption: SIGTERM / SIGUSR1 (SLURM's warning signal) ask the run to save and stop."""

import signal

import torch
import torch.distributed as dist

from oryx_megatron.parallel import current_device

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Records a preemption signal; ranks agree on it at step boundaries."""

    def __init__(self):
        self.received = None
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}

    def _on_signal(self, signum, frame):
        self.received = signal.Signals(signum).name

    def should_stop(self) -> bool:
        """True on every rank once any rank has received a signal (a collective call)."""
        flag = torch.tensor([int(self.received is not None)], device=current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
