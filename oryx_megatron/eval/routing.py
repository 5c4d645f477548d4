"""Quality against attention fraction: the router's schedules beside the schedules that read the same
fraction without it (docs/routing.md).

For each budget B the router reads attention on some fraction f of the tokens (``router budget=B``),
and so for each threshold P (``router threshold=P``: its own decisions, no calibration); at that
fraction f the baselines read: random chunks (each chunk attention with probability f), the first k
and the last k chunks (k = f x chunks, rounded), and ``entropy``, a baseline without parameters: the k
chunks of the evaluated samples whose first token's next-token distribution, read all-linear, has the
highest entropy (where the cheap read is least sure; each chunk's score is causal, the cut is the
samples' (1 - f) quantile, so the fraction matches). Beside them all_linear, all_attention and, for
MQAR, the oracle (attention on the query spans). Rows are labelled by the budget or threshold they are
matched to (``router@0.1``, ``random@0.1``, ``router@p0.5``, ...), so the same rows of every seed average.

- ``quality="mqar"``: answer accuracy on the test set (``evaluate_retrieval``'s), ``se`` its standard
  error over samples;
- ``quality="ppl"``: held-out loss (``evaluate_ppl``'s windows), ``se`` its standard error over windows.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from oryx_megatron.config import Mode
from oryx_megatron.data.modes import (
    Explicit,
    ModeSchedule,
    RandomChunks,
    SampleModes,
    all_attention,
    all_linear,
)
from oryx_megatron.data.schedules import RouterSchedule
from oryx_megatron.eval.ppl import dataset_vocab, schedule_batches, token_losses
from oryx_megatron.eval.retrieval import answer_accuracy, build_task
from oryx_megatron.run_config import TrainConfig

QUALITIES = ("mqar", "ppl")
BASELINES = ("random", "first", "last", "entropy")


def matched_baselines(fraction: float, chunk_size: int, seq_len: int) -> Dict[str, ModeSchedule]:
    """The schedules reading ``fraction`` of the tokens without a router: random, first and last chunks."""
    n = -(-seq_len // chunk_size)
    k = min(n, round(fraction * n))
    first = tuple([Mode.ATTENTION] * k + [Mode.LINEAR] * (n - k))
    return {"random": RandomChunks(chunk_size=chunk_size, p_attention=min(max(fraction, 0.0), 1.0)),
            "first": Explicit(chunk_modes=first, chunk_size=chunk_size),
            "last": Explicit(chunk_modes=first[::-1], chunk_size=chunk_size)}


@torch.no_grad()
def linear_entropy(model, batches: List[Dict[str, Tensor]], chunk_size: int, vocab_size: int) -> Tensor:
    """The entropy (nats) of the all-linear next-token distribution (over the tokenizer's ids) at each chunk's
    first token: [n, ceil(s / chunk_size)] of the batches' tokens [n, s] (and document_ids, if any)."""
    device = next(model.parameters()).device
    out = []
    for b in batches:
        docs = b.get("document_ids")
        logits = model(b["tokens"].to(device), Mode.LINEAR, document_ids=None if docs is None else docs.to(device))
        logits = logits[:, ::chunk_size, :vocab_size].float()
        out.append(torch.distributions.Categorical(logits=logits).entropy().cpu())
    return torch.cat(out)


def top_chunks(scores: Tensor, fraction: float, chunk_size: int, seq_len: int) -> np.ndarray:
    """int8 modes [n, seq_len]: attention on the round(fraction x chunks) chunks of highest score [n, chunks]."""
    k = min(scores.numel(), round(fraction * scores.numel()))
    attend = torch.zeros(scores.numel(), dtype=torch.bool)
    attend[torch.topk(scores.flatten(), k).indices] = True
    modes = torch.where(attend.view(scores.shape), Mode.ATTENTION, Mode.LINEAR)
    return modes.repeat_interleave(chunk_size, dim=1)[:, :seq_len].numpy().astype(np.int8)


def evaluate_routing(model, run: TrainConfig, quality: str = "mqar", budgets: Sequence[float] = (0.05, 0.1, 0.2),
                     thresholds: Sequence[float] = (), chunk_size: Optional[int] = None, num_samples: int = 512,
                     batch_size: int = 64, seed: int = 0, num_pairs: Optional[int] = None,
                     num_queries: Optional[int] = None, query_spans: Optional[int] = None,
                     num_batches: int = 8) -> dict:
    """One row per schedule: label, kind (all / oracle / router / random / first / last / entropy), budget and
    threshold (the router schedule's a row is matched to; the other is None), attention_fraction, and the
    quality (mqar: accuracy, token_accuracy; ppl: loss) with its standard error ``se``."""
    if quality not in QUALITIES:
        raise ValueError(f"routing quality {quality!r}: expected one of {QUALITIES}")
    chunk = chunk_size or run.router.chunk_size
    seq_len = run.data.seq_length
    vocab = dataset_vocab(run)[0]
    if quality == "mqar":
        sample, oracle, _ = build_task("mqar", run, num_samples, seq_len, seed, "random",
                                       num_pairs or run.data.mqar_num_pairs, num_queries or run.data.mqar_num_queries,
                                       1, 1, 1, query_spans)
        inputs = torch.from_numpy(np.ascontiguousarray(sample["inputs"]))
        batches = [dict(tokens=inputs[i : i + batch_size]) for i in range(0, num_samples, batch_size)]

        def measure(schedule) -> dict:  # a schedule, or modes [samples, s]
            if isinstance(schedule, np.ndarray):
                schedule = SampleModes(schedule, "given modes")
            row = answer_accuracy(model, sample, schedule, vocab, batch_size)
            return dict(row, se=float(np.sqrt(row["accuracy"] * (1 - row["accuracy"]) / num_samples)))
    else:
        oracle = None
        batches = schedule_batches(model, run, num_batches, batch_size, all_linear())

        def measure(schedule) -> dict:  # a schedule, or modes [windows, s]
            given = isinstance(schedule, np.ndarray)
            batches = schedule_batches(model, run, num_batches, batch_size, all_linear() if given else schedule)
            for b, modes in zip(batches, torch.from_numpy(schedule).split(batch_size) if given else ()):
                b["modes"] = modes
            losses = token_losses(model, batches)  # [windows, s]
            per_window = losses.mean(1)
            attention = torch.cat([b["modes"] for b in batches]) == Mode.ATTENTION
            return dict(loss=float(losses.mean()), se=float(per_window.std() / np.sqrt(len(per_window))),
                        attention_fraction=float(attention.float().mean()))

    entropy = linear_entropy(model, batches, chunk, vocab)
    unmatched = dict(budget=None, threshold=None)
    rows: List[dict] = [dict(schedule=name, kind="all", **unmatched, **measure(schedule))
                        for name, schedule in (("all_linear", all_linear()), ("all_attention", all_attention()))]
    if oracle is not None:
        rows.append(dict(schedule="oracle", kind="oracle", **unmatched, **measure(oracle)))
    routers = [(f"{b:g}", dict(budget=b, threshold=None)) for b in budgets]
    routers += [(f"p{t:g}", dict(budget=None, threshold=t)) for t in thresholds]
    for tag, spec in routers:
        routed = measure(RouterSchedule(**spec, chunk_size=chunk))
        rows.append(dict(schedule=f"router@{tag}", kind="router", **spec, **routed))
        fraction = routed["attention_fraction"]
        baselines = {**matched_baselines(fraction, chunk, seq_len), "entropy": top_chunks(entropy, fraction, chunk, seq_len)}
        for kind, schedule in baselines.items():
            rows.append(dict(schedule=f"{kind}@{tag}", kind=kind, **spec, **measure(schedule)))
    return dict(task=f"routing/{quality}", chunk_size=chunk, budgets=list(budgets), thresholds=list(thresholds),
                seq_len=seq_len, rows=rows)
