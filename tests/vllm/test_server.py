"""`oryx-vllm serve` on 127.0.0.1, with and without --skip-tokenizer-init: every malformed request of TABLE is an
HTTP 4xx naming what is wrong, and the same server then answers good requests with oryx-generate's tokens (a
per-request schedule; a text prompt through the folder's tokenizer); a bounded soak of mixed and cancelled
requests leaves every state slot free; a refused deployment is one line on stderr."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

MAX_MODEL_LEN = 256
VOCAB = 4096  # tiny_oryx_tg's
SERVE = [str(Path(sys.executable).with_name("oryx-vllm")), "serve"]
FLAGS = ["--trust-remote-code", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
         "--gpu-memory-utilization", "0.3"]
ENV = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}

# (what is wrong, the request's fields over a good one's, a part of the answer's message)
TABLE = [
    ("an id past the vocabulary", {"prompt": [5, VOCAB]}, f"Token id {VOCAB} is out of vocabulary"),  # the plugin's
    ("a negative id", {"prompt": [-1, 5]}, "body.prompt.0', 'msg': 'Input should be greater than or equal to 0"),
    ("an empty prompt", {"prompt": []}, "You must pass at least one prompt"),
    ("an empty text prompt", {"prompt": ""}, "Either prompt or prompt_embeds must be provided and non-empty"),
    ("a schedule that does not parse", {"vllm_xargs": {"oryx_schedule": "sometimes_attention"}},
     "oryx_schedule='sometimes_attention'"),
    ("a closed span", {"vllm_xargs": {"oryx_schedule": "linear:0-100"}}, "the last span must be open-ended"),
    ("a router schedule", {"vllm_xargs": {"oryx_schedule": "router budget=0.1"}}, "router schedules are not served"),
    ("a schedule that is not a string", {"vllm_xargs": {"oryx_schedule": 5}}, "oryx_schedule=5: expected a schedule"),
    ("a prompt past max_model_len", {"prompt": [5] * (MAX_MODEL_LEN + 1)},
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, your prompt contains at least {MAX_MODEL_LEN + 1}"),
    ("max_tokens 0", {"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ("max_tokens -1", {"max_tokens": -1}, "max_tokens must be at least 1, got -1"),
]
NO_TOKENIZER = ("a text prompt", {"prompt": "def"}, "Tokenizer not available when `skip_tokenizer_init=True`")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict):
    """(HTTP status, the answer's JSON) of a completion request."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def servers(folders):
    """Both servers (skip_tokenizer_init -> (port, process)), started at once: their start-ups overlap."""
    root, _ = folders
    started = {}
    try:
        for skip_tokenizer in (True, False):
            port = free_port()
            command = SERVE + [str(root / "oryx_tg"), "--host", "127.0.0.1", "--port", str(port)] + FLAGS
            command += ["--skip-tokenizer-init"] if skip_tokenizer else []
            started[skip_tokenizer] = port, subprocess.Popen(command, env=ENV, stdout=subprocess.DEVNULL,
                                                             stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + 300
        for port, process in started.values():
            while True:
                assert process.poll() is None, process.stderr.read().decode()[-3000:]
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "oryx-vllm serve did not start in 300 s"
                    time.sleep(2)
        yield started
    finally:
        for _, process in started.values():
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
            process.stderr.close()


@pytest.fixture(params=[True, False], ids=["skip_tokenizer_init", "tokenizer"])
def server(request, servers, folders):
    root, expected = folders
    port, process = servers[request.param]
    return request.param, str(root / "oryx_tg"), port, process, expected


def good(folder: str, expected: dict) -> dict:
    return {"model": folder, "prompt": expected["prompts"][1], "max_tokens": expected["new_tokens"], "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"oryx_schedule": "all_linear"}}


def test_every_malformed_request_is_a_4xx_naming_it_and_the_server_serves_on(server):
    skip_tokenizer, folder, port, process, expected = server
    for what, fields, message in TABLE + ([NO_TOKENIZER] if skip_tokenizer else []):
        status, answer = post(port, {**good(folder, expected), **fields})
        assert 400 <= status < 500, (what, status, answer)
        assert message in answer["error"]["message"], (what, answer)
    assert process.poll() is None
    status, answer = post(port, good(folder, expected))
    assert status == 200, answer
    assert answer["choices"][0]["token_ids"] == expected["tokens"]["oryx_tg"]["all_linear"][1]


def test_a_prompt_and_max_tokens_past_max_model_len_stop_at_max_model_len(server):
    _, folder, port, _, expected = server
    prompt = (expected["prompts"][0] * 2)[: MAX_MODEL_LEN - 10]  # 10 tokens left
    status, answer = post(port, {**good(folder, expected), "prompt": prompt, "max_tokens": 32})
    assert status == 200, answer
    assert len(answer["choices"][0]["token_ids"]) == 10 and answer["choices"][0]["finish_reason"] == "length"


def test_a_text_prompt_reads_the_folders_tokenizer(server):
    skip_tokenizer, folder, port, _, expected = server
    if skip_tokenizer:
        pytest.skip("no tokenizer: the table's text prompt is refused")
    text = expected["text"]
    status, answer = post(port, {**good(folder, expected), "prompt": text["prompt"]})
    assert status == 200, answer
    assert answer["choices"][0]["prompt_token_ids"] == text["token_ids"]
    assert answer["choices"][0]["token_ids"] == text["tokens"]


def test_a_refused_deployment_is_one_line_on_stderr(folders):
    root, _ = folders
    command = SERVE + [str(root / "oryx_tg"), "--host", "127.0.0.1", "--port", str(free_port())] + FLAGS
    command += ["--skip-tokenizer-init", "--hf-overrides", json.dumps({"serving_schedule": "router threshold=0.5"})]
    out = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("oryx-vllm: serving_schedule='router threshold=0.5': router schedules are not served")
    assert "Traceback" not in out.stderr


SOAK_REQUESTS, SOAK_CLIENTS, SOAK_SECONDS = 240, 12, 90
RSS_GROWTH_MIB = 512  # the server's processes after the soak, against after its first answers


def metrics(port: int) -> dict:
    """The server's Prometheus gauges (name -> value, labels dropped)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    return {line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:") and not line.startswith("#")}


def rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its descendants (the API server and its engine process)."""
    total, pending = 0, [pid]
    while pending:
        p = pending.pop()
        status = Path(f"/proc/{p}/status").read_text()
        total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        for task in Path(f"/proc/{p}/task").iterdir():
            pending += [int(c) for c in (task / "children").read_text().split()]
    return total / 1024


def stream_and_cancel(port: int, body: dict, after: int) -> None:
    """A streamed completion whose client goes away after ``after`` chunks (vLLM aborts the request)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        for i, _ in enumerate(answer):
            if i >= after:
                break


def test_a_soak_of_mixed_requests_leaves_every_slot_free_and_answers_right(server):
    """SOAK_REQUESTS requests from SOAK_CLIENTS clients at once: random prompt lengths, budgets and schedules, one in
    six cancelled mid-stream, oryx-generate's prompts among them (their answers checked); afterwards no request runs
    or waits, every state slot is free again and the server's memory grew by less than RSS_GROWTH_MIB."""
    skip_tokenizer, folder, port, process, expected = server
    if not skip_tokenizer:
        pytest.skip("one server is enough")
    before = rss_mib(process.pid)
    rng, schedules = random.Random(0), list(expected["tokens"]["oryx_tg"])
    checked = [(schedule, i) for schedule in schedules for i in range(len(expected["prompts"]))]
    jobs = [("check", *case) for case in checked]
    for n in range(SOAK_REQUESTS - len(jobs)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 200))]
        budget = rng.randint(1, min(48, MAX_MODEL_LEN - len(prompt)))
        jobs.append(("cancel" if n % 6 == 0 else "run", rng.choice(schedules), prompt, budget))
    rng.shuffle(jobs)
    wrong = []

    def run(job):
        body = good(folder, expected)
        if job[0] == "check":
            _, schedule, i = job
            status, answer = post(port, {**body, "prompt": expected["prompts"][i], "vllm_xargs": {"oryx_schedule": schedule}})
            if status != 200 or answer["choices"][0]["token_ids"] != expected["tokens"]["oryx_tg"][schedule][i]:
                wrong.append((schedule, i, status))
            return
        kind, schedule, prompt, budget = job
        body = {**body, "prompt": prompt, "max_tokens": budget, "vllm_xargs": {"oryx_schedule": schedule}}
        if kind == "cancel":
            stream_and_cancel(port, body, after=2)
        elif post(port, body)[0] != 200:
            wrong.append((schedule, len(prompt), budget))

    start, peak = time.monotonic(), 0.0
    with ThreadPoolExecutor(SOAK_CLIENTS) as pool:
        done = pool.map(run, jobs)
        while time.monotonic() - start < 5:  # the gauge counts the slots held while requests run
            peak = max(peak, metrics(port)["vllm:kv_cache_usage_perc"])
            time.sleep(0.5)
        list(done)
    assert time.monotonic() - start < SOAK_SECONDS, "the soak took longer than its bound"
    assert not wrong and peak > 0
    deadline = time.monotonic() + 30
    while (gauges := metrics(port))["vllm:num_requests_running"] or gauges["vllm:num_requests_waiting"]:
        assert time.monotonic() < deadline, gauges  # cancelled requests are aborted, not left running
        time.sleep(1)
    assert gauges["vllm:kv_cache_usage_perc"] == 0  # every state slot free again
    growth = rss_mib(process.pid) - before
    assert process.poll() is None and growth < RSS_GROWTH_MIB, growth
