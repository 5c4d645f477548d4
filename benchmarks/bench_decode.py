"""Per-token decode and prefill time of ``oryx_megatron.inference.generate`` against peers of the same shape.

    .venv/bin/python -m benchmarks.bench_decode [--batches 1 8] [--prompt 64] [--new-tokens 96] [--repeats 3] \\
        [--families transformer oryx_tg ...] [--peers all | same-weights | foreign] [--scale tiny | 130m] [--check]

Rows (the families' tiny recipes, or with ``--scale 130m`` their ``<family>_130m`` ones; random weights, fp32, eager,
one thread, greedy), at each batch, of both kinds by default.

Same-weight peers: every family under every schedule it reads (all_attention, all_linear, prefill=linear
decode=attention, and a router schedule on an Oryx model given a random router, ``router threshold=0.5``). The peer
holds the same weights and must give the same greedy tokens (asserted):

- the Transformer: stock ``transformers.LlamaForCausalLM`` on the converted weights (``interop.hf_convert``);
- the Oryx families and the gdn / mamba2 baselines: the Hugging Face front end as it was at commit d67187c
  (pinned: ``git archive d67187c oryx_megatron`` is extracted to a temporary folder and run in a subprocess with
  that folder first on sys.path; it converts the megatron state dict with its own ``hf.convert``). It did not
  route: a router row's peer reads the modes this run's router decided (``route_modes`` over the whole sequence,
  per row, as generate's ``modes``).

Foreign peers: transformers' classes, built by their constructors at the recipe's shape (layers, hidden size, heads
H, d_k, d_v, conv kernel, vocab, tied embeddings) with random weights (seed 0), against the all_linear rows of
mamba2 / Oryx-TM and gdn / Oryx-TG; other weights, so their tokens are not compared.

- ``Mamba2ForCausalLM``: ``num_heads`` H, ``head_dim`` d_v, ``expand`` H d_v / hidden, ``state_size`` d_k,
  ``n_groups`` H (one B/C per head, as ours), no conv bias (ours has none), our chunk size and eps. It differs: no
  MLP (a block is RMSNorm + mixer; tiny: 0.86M parameters against our mamba2's 1.45M: ours add an RMSNorm and a SwiGLU
  MLP of ffn_hidden_size to every layer), and its gated norm normalises y * silu(z) per head where ours
  normalises y and then multiplies by silu(g).
- ``Qwen3NextForCausalLM (all GDN)``: ``layer_types`` all "linear_attention", H key and H value heads of d_k / d_v,
  a dense SwiGLU MLP of ffn_hidden_size in every layer (``mlp_only_layers`` = all of them: no MoE block), our eps.
  The recurrence is ours (L2-normalised q, k, q scaled by 1/sqrt(d_k), beta = sigmoid, decay -exp(A_log)
  softplus(a + dt_bias)); it differs in that its output norm has one weight [d_v] shared by the heads (ours one
  per head; tiny: 384 parameters fewer), its RMSNorms scale by (1 + w), one conv runs over q|k|v (ours one per
  stream, the same taps), and it computes rotary tables every forward that no layer reads. transformers 5.25's
  Qwen3NextModel builds the full-attention mask through the cache even when no layer is full attention, and a
  cache of linear layers only raises there (``get_mask_sizes``): the peer's config names an attention
  implementation registered without a mask function (``NO_MASK``, sdpa), for which ``create_causal_mask`` returns
  None (no layer would read it).
- Oryx-TM and Oryx-TG in linear mode also project the attention query and write the KV cache every token (both
  memories absorb every token); the peers keep no KV cache.

Torch path: mamba_ssm, causal_conv1d and fla are not installed in .venv, and transformers 5.25 sends CPU inputs to
its torch functions even where they are (``use_kernel_func_from_hub_with_fallback``: those packages are marked
CUDA-only), as its "falling back to its reference PyTorch implementation" warnings on stderr say. Hub kernels (the
``kernels`` package is installed) come only with kernelize, which ``from_pretrained`` would call: the peers are
built by their constructors, on the CPU, and ``use_kernels`` is checked False (``_torch_path``).

Each row: prefill ms (one cached forward of the prompt; for the peers, from ``generate``'s start to its first token),
decode ms per generated token after the first (``GenerationStats`` for ours; for the peers the clock of a streamer,
``StepClock``, that ``generate`` hands the prompt and then each new token), and their ratios ours / peer. Repeats
interleave ours and the peer's; medians are reported. ``--check`` exits 1 when a decode ratio exceeds its target,
issue 43's: the Transformer against Llama and the Oryx families against the pinned front end 0.8 at batch 1 and 1.0
at batch 8; foreign peers 1.0. The issue sets no target for the gdn / mamba2 baselines against the pinned front end
(theirs are the foreign peers): those rows are held to 1.0, not slower on the same weights.
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
from oryx_megatron.config import MixerConfig
from oryx_megatron.models.builder import build_model, padded_vocab_size, transformer_config
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
TARGETS = {1: 0.8, 8: 1.0}  # batch -> the largest decode ratio ours / same-weight peer that --check accepts
BASELINES, BASELINE_TARGET = ("gdn", "mamba2"), 1.0  # single-mixer baselines against the pinned front end
FOREIGN = {"mamba2": "mamba2", "oryx_tm": "mamba2", "gdn": "gdn", "oryx_tg": "gdn"}  # family -> its foreign peer
FOREIGN_NAMES = {"mamba2": "Mamba2ForCausalLM", "gdn": "Qwen3NextForCausalLM (all GDN)"}
FOREIGN_SCHEDULE, FOREIGN_TARGET = "all_linear", 1.0  # the rows against a foreign peer, at every batch
PEERS = ("all", "same-weights", "foreign")
SCALES = {"tiny": "tiny_{family}", "130m": "{family}_130m"}  # --scale -> the recipe of a family
NO_MASK = "sdpa_no_mask"  # an attention implementation without a mask function (the module docstring: Qwen3-Next)
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


class StepClock:
    """A streamer for transformers' ``generate``: the time of each ``put`` (the prompt, then each new token)."""

    def __init__(self):
        self.times = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generate(model, prompts, schedule, new: int, **kwargs) -> dict:
    """A Hugging Face model's greedy ``generate``: its tokens, its prefill ms (from the start to its first token) and
    its decode ms per token after the first, from the clock of a streamer. ``schedule``: a schedule text, per-row modes
    of every position fed, or None (the model's only mode: LlamaForCausalLM)."""
    ids = torch.tensor(prompts)
    if schedule is None:
        extra = {}
    elif isinstance(schedule, list):  # per-row modes of every position fed (a router's decisions)
        extra = {"modes": torch.tensor(schedule)}
    else:
        extra = {"schedule": schedule}
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, streamer=clock,
                             **extra, **kwargs)
    start, first, last = clock.times[0], clock.times[1], clock.times[-1]  # the prompt's put, new tokens' puts
    return dict(tokens=out[:, ids.shape[1]:].tolist(), prefill_ms=(first - start) * 1e3,
                decode_ms=(last - first) / max(new - 1, 1) * 1e3)


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

    return inspect.getsource(StepClock) + inspect.getsource(time_generate) + WORKER


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
    return one_mode_peer(hf_model(config, megatron_to_hf(model.state_dict(), config)))


def one_mode_peer(hf):
    """A peer of one mode (no schedule): ``hf``'s greedy generate, timed."""
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


def rows_of(family: str, batches, prompt_len: int, new: int, repeats: int, folder: Path, peers: str = "all",
            scale: str = "tiny"):
    recipe = SCALES[scale].format(family=family)
    model = build(recipe, prompt_len + new, torch.float32, "cpu")
    if peers != "foreign":
        yield from same_weight_rows(family, recipe, model, batches, prompt_len, new, repeats, folder)
    if peers != "same-weights" and family in FOREIGN:
        args = dataclasses.replace(load_model_args([f"model={recipe}"]), max_sequence_length=model.max_sequence_length)
        yield from foreign_rows(family, model, args, batches, prompt_len, new, repeats)


def same_weight_rows(family: str, recipe: str, model, batches, prompt_len: int, new: int, repeats: int,
                     folder: Path):
    routed = None
    peer = llama_peer(model, recipe) if family == "transformer" else PinnedFrontEnd(recipe, prompt_len + new, model,
                                                                                     folder)
    try:
        for schedule in SCHEDULES[family]:
            if schedule == ROUTER:
                routed = routed or router_model(recipe, prompt_len + new)
            subject = routed if schedule == ROUTER else model
            for batch in batches:
                yield compare(family, schedule, batch, subject, peer,
                              "llama" if family == "transformer" else f"hf@{PIN}", prompt_len, new, repeats)
    finally:
        if isinstance(peer, PinnedFrontEnd):
            peer.close()


def foreign_rows(family: str, model, args, batches, prompt_len: int, new: int, repeats: int):
    """``model`` (family's, of recipe ``args``) in linear mode against its foreign peer at ``args``' shape."""
    kind = FOREIGN[family]
    peer = one_mode_peer((mamba2_model if kind == "mamba2" else qwen3_next_gdn_model)(args))
    for batch in batches:
        yield compare(family, FOREIGN_SCHEDULE, batch, model, peer, FOREIGN_NAMES[kind], prompt_len, new, repeats,
                      same_weights=False)


def compare(family, schedule, batch, subject, peer, name, prompt_len, new, repeats, same_weights=True) -> dict:
    """One row: ``repeats`` interleaved runs of ours and the peer's after a warm-up of each, on random prompts; a
    same-weight peer's greedy tokens must equal ours."""
    g = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, subject.vocab_size, (batch, prompt_len), generator=g).tolist()
    mine, theirs = [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up
        mine.append(ours(subject, prompts, schedule, new))
        peer_schedule = schedule if schedule != ROUTER else mine[-1]["modes"].long().tolist()
        theirs.append(peer(prompts, peer_schedule, new))
        if same_weights and mine[-1]["tokens"] != theirs[-1]["tokens"]:
            raise AssertionError(f"{family} {schedule} batch {batch}: greedy tokens differ from the peer's")
    return row(family, schedule, batch, name, mine[1:], theirs[1:],
               target(family, batch, same_weights))


def target(family: str, batch: int, same_weights: bool) -> float:
    """The largest decode ratio ours / peer that ``--check`` accepts for a row (the module docstring)."""
    if not same_weights:
        return FOREIGN_TARGET
    return BASELINE_TARGET if family in BASELINES else TARGETS.get(batch, 1.0)


def mamba2_model(args):
    """transformers' Mamba2ForCausalLM at recipe ``args``' shape (the module docstring says what differs)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    m = MixerConfig(**args.mixer_fields())  # d_k, d_v filled in
    expand, rest = divmod(m.num_attention_heads * m.value_head_dim, args.hidden_size)
    if rest or not expand:
        raise ValueError(f"Mamba2Config: heads * value_head_dim ({m.num_attention_heads} * {m.value_head_dim}) "
                         f"must be a multiple of hidden_size ({args.hidden_size})")
    return _torch_path(Mamba2ForCausalLM, Mamba2Config(
        num_hidden_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=m.num_attention_heads,
        head_dim=m.value_head_dim, expand=expand, state_size=m.kv_channels, n_groups=m.num_attention_heads,
        conv_kernel=m.mixer_conv_kernel, use_conv_bias=False, chunk_size=m.linear_chunk_size,
        layer_norm_epsilon=m.layernorm_epsilon, vocab_size=padded_vocab_size(args),
        tie_word_embeddings=args.share_embeddings_and_output_weights, initializer_range=args.init_method_std,
        pad_token_id=None, bos_token_id=None, eos_token_id=None))


def qwen3_next_gdn_model(args):
    """transformers' Qwen3NextForCausalLM, every layer Gated DeltaNet and a dense MLP, at recipe ``args``' shape."""
    from transformers import AttentionInterface, Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(NO_MASK, sdpa_attention_forward)  # no mask function: create_causal_mask -> None
    m, layers = MixerConfig(**args.mixer_fields()), args.num_layers
    return _torch_path(Qwen3NextForCausalLM, Qwen3NextConfig(
        num_hidden_layers=layers, layer_types=["linear_attention"] * layers, mlp_only_layers=list(range(layers)),
        hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size or 4 * args.hidden_size,
        linear_num_key_heads=m.num_attention_heads, linear_num_value_heads=m.num_attention_heads,
        linear_key_head_dim=m.kv_channels, linear_value_head_dim=m.value_head_dim,
        linear_conv_kernel_dim=m.mixer_conv_kernel, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, head_dim=m.kv_channels, rms_norm_eps=m.layernorm_epsilon,
        vocab_size=padded_vocab_size(args), tie_word_embeddings=args.share_embeddings_and_output_weights,
        max_position_embeddings=args.max_sequence_length, initializer_range=args.init_method_std,
        attn_implementation=NO_MASK))


def _torch_path(cls, config):
    """cls(config), random weights (seed 0), on the CPU and not kernelized: transformers' torch path."""
    torch.manual_seed(0)
    model = cls(config).eval()
    if model.use_kernels or any(p.device.type != "cpu" for p in model.parameters()):
        raise RuntimeError(f"{cls.__name__}: expected transformers' torch path (CPU, no hub kernels)")
    return model


def router_model(recipe: str, length: int):
    """The recipe's model with a random router of one layer whose logits fall on both sides of 0.5."""
    args = dataclasses.replace(load_model_args([f"model={recipe}"]), max_sequence_length=length, router_hidden=8,
                               router_chunk_size=16, router_layers=1)
    torch.manual_seed(0)
    model = build_model(args, transformer_config(args, perform_initialization=True)).eval()
    with torch.no_grad():
        model.router.fc2.weight.normal_(std=3.0)
    return model


def row(family, schedule, batch, peer, mine, theirs, target) -> dict:
    med = {key: (statistics.median(r[key] for r in mine), statistics.median(r[key] for r in theirs))
           for key in ("prefill_ms", "decode_ms")}
    return dict(family=family, schedule=schedule, batch=batch, peer=peer,
                prefill_ms=med["prefill_ms"][0], peer_prefill_ms=med["prefill_ms"][1],
                prefill_ratio=med["prefill_ms"][0] / med["prefill_ms"][1],
                decode_ms=med["decode_ms"][0], peer_decode_ms=med["decode_ms"][1],
                decode_ratio=med["decode_ms"][0] / med["decode_ms"][1], target=target)


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
    parser.add_argument("--peers", default="all", choices=PEERS, help="same-weight peers, foreign ones, or both")
    parser.add_argument("--scale", default="tiny", choices=list(SCALES), help="the families' recipes")
    parser.add_argument("--check", action="store_true", help="exit 1 when a decode ratio misses its target")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.peers != "foreign" and any(f != "transformer" for f in args.families):
            extract_pinned(folder)
        for family in args.families:
            rows += rows_of(family, args.batches, args.prompt, args.new_tokens, args.repeats, folder, args.peers,
                            args.scale)
    print(f"{args.scale} recipes, random weights, float32, cpu, 1 thread, prompt {args.prompt}, {args.new_tokens} new tokens, "
          f"greedy (equal tokens asserted on the same weights), median of {args.repeats} interleaved; "
          "ratio = ours / peer")
    print(table(rows))
    missed = [r for r in rows if r["decode_ratio"] > r["target"]]
    for r in missed:
        print(f"missed: {r['family']} {r['schedule']} batch {r['batch']} against {r['peer']}: decode "
              f"{r['decode_ratio']:.2f}x > {r['target']}x")
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
