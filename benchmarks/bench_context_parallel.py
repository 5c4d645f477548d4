"""Context parallelism on the CPU: a training step's time and the activations one forward saves for the backward,
per rank, at CP=1 and CP=2 (gloo processes, toy models), every family, and the memory formula of docs/training.md
("Context parallelism") checked against them; ``--table`` adds the formula's memory per GPU of the 1.4B recipes at
32k and 128k tokens.

    .venv/bin/python benchmarks/bench_context_parallel.py --seq 256 512 1024
    .venv/bin/python benchmarks/bench_context_parallel.py --seq 256 --table   # + the 1.4B table (a 1.4B layer, bf16)

Activations: the bytes of the distinct storages autograd saves during one forward with the loss, parameters
left out (``torch.autograd.graph.saved_tensors_hooks``), on rank 0. The formula: a rank of a CP group holds
``layers x micro_batch x (a seq + q seq^2) / CP`` bytes of activations: ``a`` per token and layer; ``q`` the
attention probabilities that the CPU's math attention keeps (the GPU's flash and FlexAttention keep none); both
fitted on a family's two shortest CP=1 rows, "formula" their prediction for every row (the longer ones and CP=2
check it). Step: forward, backward and an
AdamW step, median of ``--repeats`` after one warm-up. GPU rows: context parallelism needs one GPU per rank
(multi-GPU only; the GPU session measures none).
"""

import argparse
import os
import socket
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from oryx_megatron.compat.cpu import cuda_to_cpu
from oryx_megatron.config import ModelArgs
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import destroy_parallel, initialize_parallel, this_rank_tokens

FAMILIES = ("oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer")
GIB = 2 ** 30


def saved_bytes(step, model) -> int:
    """Bytes of the distinct storages autograd saves while ``step()`` runs its forward, the model's parameters
    (which a matmul saves for its input's gradient) left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    return loss, sum(storages.values())


def measure(family: str, seq: int, micro_batch: int, repeats: int, layers: int, size: str, dtype) -> Dict:
    """One family at one length on this rank of the current layout: activation bytes and step seconds."""
    args = load_model_args([f"model={size.format(family=family)}", f"model.num_layers={layers}",
                            f"model.max_sequence_length={seq}"])
    cp = dist.get_world_size()
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, params_dtype=dtype, context_parallel_size=cp))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (micro_batch, seq + 1), generator=g)
    modes = (torch.arange(seq) // 64 % 2).expand(micro_batch, seq)  # 64-token chunks, every other one attention
    local = this_rank_tokens(tokens=ids[:, :-1], labels=ids[:, 1:])

    def forward():
        with cuda_to_cpu():
            return model(local["tokens"], modes, labels=local["labels"]).float().mean()

    def step():
        loss = forward()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    loss, activations = saved_bytes(forward, model)
    loss.backward()
    optimizer.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(family=family, seq=seq, cp=cp, step_s=statistics.median(times), activations=activations,
                layers=layers, micro_batch=micro_batch)


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, rows: List) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, args.threads // world))
    initialize_parallel(context_parallel_size=world)
    try:
        for family in args.family:
            for seq in args.seq:
                row = measure(family, seq, args.micro_batch, args.repeats, args.layers, args.size, torch.float32)
                if rank == 0:
                    rows.append(row)
    finally:
        destroy_parallel()


def run_layout(cp: int, args: argparse.Namespace) -> List[Dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rows = mp.Manager().list()
    mp.spawn(_rank, args=(cp, port, args, rows), nprocs=cp, join=True)
    return list(rows)


def fit(rows: List[Dict]) -> Tuple[float, float]:
    """(a, q) of bytes = layers x micro_batch x (a seq + q seq^2) from two CP=1 rows of one family: a per token
    and layer, q the attention probabilities the CPU's math attention keeps (0 for flash / FlexAttention)."""
    (s1, y1), (s2, y2) = ((r["seq"], r["activations"] / (r["layers"] * r["micro_batch"])) for r in rows[:2])
    q = (y2 / s2 - y1 / s1) / (s2 - s1)
    return y1 / s1 - q * s1, q


def with_formula(rows: List[Dict]) -> List[Dict]:
    """Each row with the formula's prediction, ``layers x micro_batch x (a seq + q seq^2) / CP``, a and q fitted
    on the family's two shortest CP=1 rows."""
    for family in {r["family"] for r in rows}:
        own = [r for r in rows if r["family"] == family]
        a, q = fit(sorted((r for r in own if r["cp"] == 1), key=lambda r: r["seq"]))
        for r in own:
            r["per_token_layer"], r["per_token2_layer"] = a, q
            r["formula"] = r["layers"] * r["micro_batch"] * (a * r["seq"] + q * r["seq"] ** 2) / r["cp"]
            one = next(o for o in own if o["seq"] == r["seq"] and o["cp"] == 1)
            r["time_vs_cp1"], r["act_vs_cp1"] = r["step_s"] / one["step_s"], r["activations"] / one["activations"]
    return sorted(rows, key=lambda r: (FAMILIES.index(r["family"]), r["seq"], r["cp"]))


def print_rows(rows: List[Dict]) -> None:
    print(f"{'family':<12}{'seq':>6}{'cp':>4}{'step ms':>10}{'vs cp1':>8}{'act MiB/rank':>14}{'vs cp1':>8}"
          f"{'formula MiB':>13}{'measured/formula':>18}")
    for r in rows:
        print(f"{r['family']:<12}{r['seq']:>6}{r['cp']:>4}{r['step_s'] * 1e3:>10.1f}{r['time_vs_cp1']:>8.2f}"
              f"{r['activations'] / 2**20:>14.2f}{r['act_vs_cp1']:>8.2f}{r['formula'] / 2**20:>13.2f}"
              f"{r['activations'] / r['formula']:>18.3f}")


TABLE_SEQS, TABLE_CPS, TABLE_GPUS = (32768, 131072), (1, 2, 4, 8), 8  # one node: data x context parallel = 8


def layer_bytes_per_token(family: str, seq: int) -> Tuple[float, ModelArgs]:
    """Activation bytes per token of one layer of the family's 1.4B recipe in bf16 (one layer, one process, the
    CPU path's torch ops: an upper bound of the GPU kernels', which recompute what they can), without the
    attention probabilities the CPU's math attention keeps (``fit`` of ``seq`` and ``2 seq``; flash and
    FlexAttention keep none)."""
    rows = [dict(seq=n, layers=1, micro_batch=1, activations=layer_activations(family, n)[0]) for n in (seq, 2 * seq)]
    return fit(rows)[0], layer_activations(family, 8)[1]


def layer_activations(family: str, seq: int) -> Tuple[int, ModelArgs]:
    """Bytes one bf16 layer of the family's 1.4B recipe saves for ``seq`` tokens, and the recipe."""
    initialize_parallel()
    args = load_model_args([f"model={family}_1_4b", "model.num_layers=1", f"model.max_sequence_length={seq}"])
    model = build_model(args, transformer_config(args, params_dtype=torch.bfloat16, bf16=True))
    ids = torch.randint(0, args.vocab_size, (1, seq))
    hidden = model.embedding(ids, position_ids=None).detach().requires_grad_()  # [s, 1, D]: the layer alone
    layer = model.decoder.layers[0]
    if family == "transformer":
        forward = lambda: layer(hidden, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(seq))[0]  # noqa
    else:
        from oryx_megatron.mixer import MixerContext

        context = MixerContext.build(model.config, torch.randint(0, 2, (1, seq)))
        forward = lambda: layer(hidden, context)  # noqa: E731
    _, saved = saved_bytes(forward, model)
    return saved - hidden.numel() * hidden.element_size(), args


def print_table(seq: int) -> None:
    """Memory per GPU of the 1.4B recipes: bf16 weights, fp32 main gradients, the distributed optimizer's fp32
    master weights and Adam moments over data x context parallel ranks (8 GPUs, TP=1, micro-batch 1, no
    recomputation), and per layer ``seq / CP`` tokens of activations (``layer_bytes_per_token``) plus the logits
    (bf16, and fp32 in the cross entropy)."""
    from oryx_megatron.models.params import meta_model

    print(f"\n{'recipe':<18}{'params':>8}{'act KiB/token/layer':>21}" + "".join(
        f"{f'{s // 1024}k cp{c} GiB':>15}" for s in TABLE_SEQS for c in TABLE_CPS))
    for family in FAMILIES:
        per_token, args = layer_bytes_per_token(family, seq)
        params = sum(p.numel() for p in meta_model(load_model_args([f"model={family}_1_4b"]))[0].parameters())
        static = params * (2 + 4 + 12 / TABLE_GPUS)
        cells = [(static + (s / c) * (args.num_layers * per_token + 6 * args.vocab_size)) / GIB
                 for s in TABLE_SEQS for c in TABLE_CPS]
        print(f"{family + '_1_4b':<18}{params / 1e9:>7.2f}B{per_token / 1024:>21.1f}" + "".join(
            f"{c:>15.1f}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--seq", nargs="+", type=int, default=[256, 512, 1024])
    parser.add_argument("--size", default="tiny_{family}", help="recipe of recipes/model/")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--table", action="store_true", help="also the 1.4B recipes' memory per GPU (docs)")
    args = parser.parse_args()
    print_rows(with_formula(run_layout(1, args) + run_layout(2, args)))
    if args.table:
        print_table(args.seq[0])


if __name__ == "__main__":
    main()
