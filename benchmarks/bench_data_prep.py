"""``oryx-prep tokenize`` against Megatron-LM's ``tools/preprocess_data.py``: wall time of each command, same corpus,
tokenizer and worker count, runs interleaved, medians.

    python benchmarks/bench_data_prep.py CORPUS.jsonl --tokenizer tokenizer.json [--megatron-lm CHECKOUT] \\
        [--workers 1 2] [--repeats 3] [--oryx-args "--shard-size 16M"]

``--megatron-lm`` is a checkout of Megatron-LM (not a dependency; tested at core_v0.16.1): its ``tools/`` and
``megatron/training`` and ``megatron/legacy`` next to the installed megatron-core, e.g.
``git archive core_v0.16.1 tools megatron/training megatron/legacy | tar -x -C CHECKOUT``. On a machine without
triton, drop the ``initialize`` and ``.training`` imports from ``CHECKOUT/megatron/training/__init__.py`` (they
import triton; preprocess_data.py uses neither). It runs with ``--tokenizer-type HuggingFaceTokenizer
--append-eod``; the tokenizer goes to it as a folder of the same ``tokenizer.json`` plus a ``tokenizer_config.json``
naming ``<|endoftext|>`` as EOS. Token counts (text + EOD) are printed for both, to show the same work was done.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd, env=None) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def oryx(corpus, tokenizer, workers, tmp: Path, extra) -> tuple:
    out = tmp / f"oryx-{workers}"
    shutil.rmtree(out, ignore_errors=True)
    prep = Path(sys.executable).with_name("oryx-prep")
    seconds = timed([str(prep), "tokenize", str(corpus), "--tokenizer", str(tokenizer), "--out", str(out),
                     "--workers", str(workers), *extra])
    manifest = json.loads((out / "manifest.json").read_text())
    return seconds, manifest["stats"]["tokens"] + manifest["stats"]["documents"]


def megatron(corpus, folder: Path, workers, tmp: Path, checkout: Path) -> tuple:
    prefix = tmp / f"megatron-{workers}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    seconds = timed([sys.executable, str(checkout / "tools" / "preprocess_data.py"), "--input", str(corpus),
                     "--output-prefix", str(prefix), "--tokenizer-type", "HuggingFaceTokenizer",
                     "--tokenizer-model", str(folder), "--append-eod", "--workers", str(workers)], env)
    tokens = Path(f"{prefix}_text_document.bin").stat().st_size // 2  # uint16 ids for a vocab < 65500
    return seconds, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("corpus", type=Path)
    p.add_argument("--tokenizer", type=Path, required=True, help="a tokenizer.json with <|endoftext|>")
    p.add_argument("--megatron-lm", type=Path, help="a Megatron-LM checkout (tools/preprocess_data.py)")
    p.add_argument("--workers", type=int, nargs="+", default=[2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--oryx-args", default="", help="extra oryx-prep tokenize arguments (default: none)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        folder = tmp / "hf-tokenizer"
        folder.mkdir()
        shutil.copyfile(args.tokenizer, folder / "tokenizer.json")
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
        runs = {}
        for _ in range(args.repeats):  # interleaved: both tools see the same machine load
            for w in args.workers:
                runs.setdefault(("oryx-prep", w), []).append(
                    oryx(args.corpus, args.tokenizer, w, tmp, args.oryx_args.split()))
                if args.megatron_lm:
                    runs.setdefault(("megatron", w), []).append(megatron(args.corpus, folder, w, tmp, args.megatron_lm))
    size = args.corpus.stat().st_size / 2**20
    print(f"{args.corpus} ({size:.0f} MiB), {args.repeats} repeats, medians (min-max)")
    print("| tool | workers | seconds | tokens incl. EOD | megatron / oryx-prep |")
    print("|---|---|---|---|---|")
    for (tool, w), r in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "oryx-prep")):
        s = [t for t, _ in r]
        ratio = ""
        if tool == "megatron":
            ratio = f"{statistics.median(s) / statistics.median(t for t, _ in runs[('oryx-prep', w)]):.2f}x"
        print(f"| {tool} | {w} | {statistics.median(s):.1f} ({min(s):.1f}-{max(s):.1f}) | {r[0][1]:,} | {ratio} |")


if __name__ == "__main__":
    main()
