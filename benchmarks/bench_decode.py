"""Per-token decode and prefill time of ``oryx_megatron.inference.generate`` against peers on the same weights.

    .venv/bin/python -m benchmarks.bench_decode [--batches 1 8] [--prompt 64] [--new-tokens 96] [--repeats 3] \\
        [--families transformer oryx_tg ...] [--check]

Rows (tiny recipes, random weights, fp32, eager, one thread, greedy): every family under every schedule it reads
(all_attention, all_linear, prefill=linear decode=attention, and a router schedule on an Oryx model given a
random router, ``router threshold=0.5``), at each batch. The peer of each row holds the same weights and must give
the same greedy tokens (asserted):

- the Transformer: stock ``transformers.LlamaForCausalLM`` on the converted weights (``interop.hf_convert``);
- the Oryx families and the gdn / mamba2 baselines: the Hugging Face front end as it was at commit d67187c
  (pinned: ``git archive d67187c oryx_megatron`` is extracted to a temporary folder and run in a subprocess with
  that folder first on sys.path; it converts the megatron state dict with its own ``hf.convert``). It did not
  route: a router row's peer reads the modes this run's router decided (``route_modes`` over the whole sequence,
  per row, as generate's ``modes``).

Each row: prefill ms (one cached forward of the prompt; for the peers a forward of the prompt with a new cache),
decode ms per generated token ((generate - prefill) / (new tokens - 1) for the peers; ``GenerationStats`` for
ours), and their ratios ours / peer. Repeats interleave ours and the peer's; medians are reported. ``--check``
exits 1 when a decode ratio exceeds its target (batch 1: 0.8; batch 8: 1.0).

Not here yet (docs/inference.md, "Where the decode time goes"): transformers' ``Mamba2ForCausalLM`` and an
all-Gated-DeltaNet ``Qwen3NextForCausalLM`` at the same shape.
"""

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.bench_inference import build
from oryx_megatron.models.builder import build_model, transformer_config
from oryx_megatron.models.params import load_model_args
from oryx_megatron.data.schedules import as_inference_schedule
from oryx_megatron.inference import generate
from oryx_megatron.inference.routing import route_modes

PIN = "d67187c"
ROUTER = "router threshold=0.5"
SCHEDULES = {  # family -> the schedules of its rows
    "transformer": ("all_attention",),
    "oryx_tg": ("all_attention", "all_linear", "prefill=linear decode=attention", ROUTER),
    "oryx_tm": ("all_attention", "all_linear", "prefill=linear decode=attention", ROUTER),
    "gdn": ("all_linear",),
    "mamba2": ("all_linear",),
}
TARGETS = {1: 0.8, 8: 1.0}  # batch -> the largest decode ratio ours / peer that --check accepts
COLUMNS = ("family", "schedule", "batch", "peer", "prefill_ms", "peer_prefill_ms", "prefill_ratio",
           "decode_ms", "peer_decode_ms", "decode_ratio", "target")

WORKER = """
import json, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(1)
from oryx_megatron.hf.convert import hf_config, hf_model, megatron_to_hf
from oryx_megatron.models.params import load_model_args
from oryx_megatron.parallel import initialize_parallel
import dataclasses
initialize_parallel()
recipe, length, state_file = sys.argv[1], int(sys.argv[2]), sys.argv[3]
args = load_model_args([f"model={recipe}"])
args = dataclasses.replace(args, max_sequence_length=max(args.max_sequence_length, length))
config = hf_config(args)
model = hf_model(config, megatron_to_hf(torch.load(state_file), config))
print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    print(json.dumps(time_generate(model, request["prompts"], request["schedule"], request["new"])), flush=True)
"""


def time_generate(model, prompts, schedule, new: int, **kwargs) -> dict:
    """A Hugging Face model's greedy ``generate``: its tokens, its prefill ms (a cached forward of the prompt) and its
    decode ms per token after the first. ``schedule``: a schedule text, per-row modes of every position fed, or None
    (the model's only mode: LlamaForCausalLM)."""
    ids = torch.tensor(prompts)
    if schedule is None:
        extra, modes = {}, {}
    elif isinstance(schedule, list):  # per-row modes of every position fed (a router's decisions)
        extra = {"modes": torch.tensor(schedule)}
        modes = {"modes": extra["modes"][:, : ids.shape[1]]}
    else:
        extra, modes = {"schedule": schedule}, {"modes": as_schedule_modes(schedule, ids.shape)}
    with torch.no_grad():
        start = time.perf_counter()
        model(ids, use_cache=True, **modes)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **extra, **kwargs)
        total = time.perf_counter() - start
    return dict(tokens=out[:, ids.shape[1]:].tolist(), prefill_ms=prefill * 1e3,
                decode_ms=(total - prefill) / max(new - 1, 1) * 1e3)


def as_schedule_modes(schedule, shape):
    """The modes [b, prompt] a schedule gives a prompt, for the peer's prefill forward."""
    positions = as_inference_schedule(schedule).position_modes(shape[1], shape[1])
    return torch.from_numpy(positions).long().expand(*shape).contiguous()


class PinnedFrontEnd:
    """The HF front end of commit ``PIN`` in a subprocess, holding one model's weights (see the module docstring)."""

    def __init__(self, recipe: str, length: int, model, folder: Path):
        state = {k: v for k, v in model.state_dict().items()
                 if not k.startswith("router.") and not k.endswith("_extra_state")}
        torch.save(state, folder / f"{recipe}.pt")
        (folder / "worker.py").write_text(_worker_source())
        self.process = subprocess.Popen(
            [sys.executable, str(folder / "worker.py"), recipe, str(length), str(folder / f"{recipe}.pt")],
            cwd=folder / "pinned", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env={"PYTHONPATH": str(folder / "pinned"), "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1",
                 "PATH": "/usr/bin:/bin"})
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the pinned front end ({PIN}) did not start: {line!r}")

    def __call__(self, prompts, schedule: str, new: int) -> dict:
        self.process.stdin.write(json.dumps(dict(prompts=prompts, schedule=schedule, new=new)) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self):
        self.process.stdin.close()
        self.process.wait()


def _worker_source() -> str:
    import inspect

    helpers = inspect.getsource(time_generate) + inspect.getsource(as_schedule_modes)
    return ("from oryx_megatron.inference.schedules import as_inference_schedule\n" + helpers
            + WORKER)


def extract_pinned(folder: Path) -> None:
    """``git archive PIN oryx_megatron`` of this checkout into folder/pinned."""
    (folder / "pinned").mkdir()
    repo = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(repo), "archive", PIN, "oryx_megatron"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder / "pinned")], input=archive, check=True)


def llama_peer(model, recipe: str):
    """Stock LlamaForCausalLM on ``model``'s converted weights."""
    from oryx_megatron.interop.hf_convert import hf_config, hf_model, megatron_to_hf

    config = hf_config(dataclasses.replace(load_model_args([f"model={recipe}"]),
                                           max_sequence_length=model.max_sequence_length))
    hf = hf_model(config, megatron_to_hf(model.state_dict(), config))
    return lambda prompts, schedule, new: time_generate(hf, prompts, None, new)


def ours(model, prompts, schedule: str, new: int) -> dict:
    result = generate(model, prompts, schedule, new)
    stats = result.stats
    modes = None
    if schedule == ROUTER:  # the modes the router decided, over every position fed, for the peer
        sequence = torch.tensor([p + t[:-1] for p, t in zip(prompts, result.tokens)])
        modes = route_modes(model, as_inference_schedule(schedule), sequence)
    return dict(tokens=result.tokens, prefill_ms=stats.prefill_seconds * 1e3,
                decode_ms=stats.decode_seconds / max(len(result.tokens[0]) - 1, 1) * 1e3, modes=modes)


def rows_of(family: str, batches, prompt_len: int, new: int, repeats: int, folder: Path):
    recipe = f"tiny_{family}"
    model = build(recipe, prompt_len + new, torch.float32, "cpu")
    routed = None
    peer = llama_peer(model, recipe) if family == "transformer" else PinnedFrontEnd(recipe, prompt_len + new, model,
                                                                                     folder)
    try:
        for schedule in SCHEDULES[family]:
            if schedule == ROUTER:
                routed = routed or router_model(family, prompt_len + new)
            subject = routed if schedule == ROUTER else model
            for batch in batches:
                g = torch.Generator().manual_seed(batch)
                prompts = torch.randint(0, model.vocab_size, (batch, prompt_len), generator=g).tolist()
                mine, theirs = [], []
                for _ in range(repeats + 1):  # the first of each is a warm-up
                    mine.append(ours(subject, prompts, schedule, new))
                    peer_schedule = schedule if schedule != ROUTER else mine[-1]["modes"].long().tolist()
                    theirs.append(peer(prompts, peer_schedule, new))
                    if mine[-1]["tokens"] != theirs[-1]["tokens"]:
                        raise AssertionError(f"{family} {schedule} batch {batch}: greedy tokens differ from the peer's")
                yield row(family, schedule, batch, "llama" if family == "transformer" else f"hf@{PIN}",
                          mine[1:], theirs[1:])
    finally:
        if isinstance(peer, PinnedFrontEnd):
            peer.close()


def router_model(family: str, length: int):
    """The family's tiny model with a random router of one layer whose logits fall on both sides of 0.5."""
    args = dataclasses.replace(load_model_args([f"model=tiny_{family}"]), max_sequence_length=length, router_hidden=8,
                               router_chunk_size=16, router_layers=1)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, perform_initialization=True)).eval()
    with torch.no_grad():
        model.router.fc2.weight.normal_(std=3.0)
    return model


def row(family, schedule, batch, peer, mine, theirs) -> dict:
    med = {key: (statistics.median(r[key] for r in mine), statistics.median(r[key] for r in theirs))
           for key in ("prefill_ms", "decode_ms")}
    return dict(family=family, schedule=schedule, batch=batch, peer=peer,
                prefill_ms=med["prefill_ms"][0], peer_prefill_ms=med["prefill_ms"][1],
                prefill_ratio=med["prefill_ms"][0] / med["prefill_ms"][1],
                decode_ms=med["decode_ms"][0], peer_decode_ms=med["decode_ms"][1],
                decode_ratio=med["decode_ms"][0] / med["decode_ms"][1], target=TARGETS.get(batch, 1.0))


def table(rows) -> str:
    """Aligned plain text, one row per measurement."""
    cells = [list(COLUMNS)] + [[f"{r[c]:,.3f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
                               for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(v.ljust(w) if i < 2 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines[:1] + ["  ".join("-" * w for w in widths)] + lines[1:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="exit 1 when a decode ratio misses its target")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if any(f != "transformer" for f in args.families):
            extract_pinned(folder)
        for family in args.families:
            rows += rows_of(family, args.batches, args.prompt, args.new_tokens, args.repeats, folder)
    print(f"tiny recipes, random weights, float32, cpu, 1 thread, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"greedy (equal tokens asserted), median of {args.repeats} interleaved; ratio = ours / peer")
    print(table(rows))
    missed = [r for r in rows if r["decode_ratio"] > r["target"]]
    for r in missed:
        print(f"missed: {r['family']} {r['schedule']} batch {r['batch']}: decode {r['decode_ratio']:.2f}x > "
              f"{r['target']}x")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
