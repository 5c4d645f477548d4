"""The chaos driver's kill plan: which iterations are killed, with which signal, aimed where."""

import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional


@dataclass
class Kill:
    index: int
    signal: str  # SIGKILL / SIGTERM
    aim: str  # step / save / write (an async save's background write)
    target: int  # the iteration after which the kill is armed
    attempt: int = -1
    sent: bool = False
    last_logged: Optional[int] = None  # the last iteration the killed attempt logged
    exit_code: Optional[int] = None
    latest_after: int = 0  # the iteration `latest` named once the process was dead (0: none)
    inside_save: bool = False  # an iteration dir written by this attempt that `latest` does not name
    # where it landed, seen with the trainer's process group stopped (watch.freeze): "write" (an async save's
    # writer process alive), "save" (a save in progress, no writer alive), "step" (neither); None: not sent
    landed: Optional[str] = None
    landed_iteration: Optional[int] = None  # the save in progress then
    writers_at_kill: int = 0  # its writer processes alive then
    files_at_kill: Dict[str, int] = field(default_factory=dict)  # its files then: name -> bytes
    missed: List[int] = field(default_factory=list)  # saves found outside the aim when stopped: aimed at the next
    incomplete_iteration: Optional[int] = None
    incomplete_files: List[str] = field(default_factory=list)
    events: List[str] = field(default_factory=list)  # how the kill was aimed (seconds since the attempt started)
    resumed_from: Optional[int] = None  # what the next attempt reported
    redone: Optional[int] = None
    lost_beyond_interval: Optional[int] = None
    survived: bool = False
    note: str = ""


def plan_kills(kills: int, train_iters: int, rng: random.Random, sigterm_fraction: float,
               save_fraction: float, save_aim: str = "save") -> List[Kill]:
    """Sorted targets; with 3 kills or more at least one SIGTERM, one SIGKILL step and one SIGKILL aimed
    at ``save_aim`` (inside a save, or inside an async save's background write)."""
    kinds = []
    for _ in range(kills):
        u = rng.random()
        kinds.append(("SIGKILL", save_aim) if u < save_fraction else
                     ("SIGTERM", "step") if u < save_fraction + sigterm_fraction else ("SIGKILL", "step"))
    if kills >= 3:
        required = [("SIGTERM", "step"), ("SIGKILL", "step"), ("SIGKILL", save_aim)]
        missing = [k for k in required if k not in kinds]
        replaceable = [i for i, k in enumerate(kinds) if kinds.count(k) > 1]
        rng.shuffle(replaceable)
        for kind in missing:
            i = replaceable.pop()
            kinds[i] = kind
            replaceable = [j for j in replaceable if kinds.count(kinds[j]) > 1]
    targets = sorted(rng.randint(1, train_iters - 1) for _ in range(kills))
    return [Kill(index=i, signal=s, aim=a, target=t) for i, ((s, a), t) in enumerate(zip(kinds, targets))]
