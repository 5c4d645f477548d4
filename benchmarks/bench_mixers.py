"""Forward+backward time of one MultiMixer layer per mixer configuration and sequence length.

    .venv/bin/python benchmarks/bench_mixers.py [--hidden 256 --heads 4 --seq 512 1024 2048]

Prints a table of milliseconds per call and the ratio against the attention-only layer
measured in the same run (the baseline). Kernels: whatever `kernel_backend=auto` picks here.
"""

import argparse
import dataclasses
import time

import torch

from oryx_megatron.config import Mode, ModelArgs
from oryx_megatron.layers.multi_mixer import MultiMixer
from oryx_megatron.mixer import MixerContext
from oryx_megatron.models.builder import transformer_config
from oryx_megatron.models.specs import get_oryx_layer_local_spec
from oryx_megatron.parallel import initialize_parallel

VARIANTS = {  # name: (family, mixers)
    "attention (baseline)": ("oryx_tg", "attention"),
    "gdn": ("gdn", "gdn"),
    "mamba2": ("mamba2", "mamba2"),
    "oryx_tg": ("oryx_tg", "attention+gdn"),
    "oryx_tm": ("oryx_tm", "attention+mamba2"),
}


def build(family, mixers, hidden, heads):
    args = ModelArgs(family=family, num_layers=1, hidden_size=hidden, num_attention_heads=heads,
                     kv_channels=hidden // heads)
    config = dataclasses.replace(transformer_config(args), mixers=mixers)
    return MultiMixer(config, get_oryx_layer_local_spec().submodules.mixer.submodules)


def time_call(mixer, x, modes, repeats):
    def call():
        out, _ = mixer(x, MixerContext.build(mixer.config, modes))
        out.sum().backward()

    call()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    initialize_parallel()
    torch.manual_seed(0)
    mixers = {name: build(*spec, args.hidden, args.heads) for name, spec in VARIANTS.items()}
    print(f"kernels: {next(iter(mixers.values())).kernels.names}")
    print(f"{'mixer':<22}" + "".join(f"{f'seq {s} ms':>16}{'ratio':>8}" for s in args.seq))
    results = {}
    for s in args.seq:
        x = torch.randn(s, args.batch, args.hidden, requires_grad=True)
        modes = torch.full((args.batch, s), int(Mode.ATTENTION), dtype=torch.int8)
        modes[:, : s // 2] = Mode.LINEAR
        for name, mixer in mixers.items():
            results[name, s] = time_call(mixer, x, modes, args.repeats)
    base = next(iter(VARIANTS))
    for name in VARIANTS:
        row = "".join(f"{results[name, s]:>16.1f}{results[name, s] / results[base, s]:>8.2f}" for s in args.seq)
        print(f"{name:<22}{row}")


if __name__ == "__main__":
    main()
