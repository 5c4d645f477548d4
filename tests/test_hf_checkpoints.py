"""oryx-export hf / oryx-import hf on a trained tiny checkpoint (docs/hf.md): the folder transformers, lm-eval
and trust_remote_code load; generation equal to oryx-generate's; megatron -> HF -> megatron bit for bit, read by
oryx-eval and trained by oryx-train as a fresh run from those weights; a TP=2 import exporting the same files;
and bad input as one named line."""

import dataclasses
import filecmp
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from oryx_megatron.checkpoint import load_common  # noqa: E402
from oryx_megatron.cli import evaluate, export_hf, import_hf  # noqa: E402
from oryx_megatron.data_prep.tokenizer import ByteTokenizer  # noqa: E402
from oryx_megatron.inference import generate  # noqa: E402
from oryx_megatron.inference.checkpoint import load_model  # noqa: E402
from oryx_megatron.interop.hf_export import heldout_losses  # noqa: E402
from tests.test_train import losses, run_config  # noqa: E402

EOD, PADDED = 256, 384
FILES = {"README.md", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"}  # and the model's code (tests/test_hf_folder.py)
PROMPT = "def main(self):\n    return"


def folder_files():
    from oryx_megatron.hf.remote_code import model_code

    return FILES | set(model_code())


def cli(main, *args):
    assert main([str(a) for a in args]) == 0


def weights(checkpoint) -> dict:
    model, _ = load_model(str(checkpoint))
    return {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}


@pytest.fixture(scope="module")
def exported(tiny_checkpoint, tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("hf") / "tiny"
    cli(export_hf.main, "hf", tiny_checkpoint, out)
    return out


@pytest.fixture(scope="module")
def imported(exported, tmp_path_factory):
    out = tmp_path_factory.mktemp("imported") / "ckpt"
    cli(import_hf.main, "hf", exported, out)
    return out


def test_export_writes_a_transformers_folder(exported):
    from transformers import AutoConfig, AutoTokenizer

    assert {p.name for p in exported.iterdir()} == folder_files()
    config = AutoConfig.from_pretrained(exported)
    assert (config.model_type, config.architectures, config.mixers, config.vocab_size) == \
        ("oryx", ["OryxForCausalLM"], "attention+gdn", PADDED)
    assert config.auto_map == {"AutoConfig": "configuration_oryx.OryxHFConfig",
                               "AutoModelForCausalLM": "modeling_oryx.OryxForCausalLM"}
    assert config.training_mode_schedule == "random_chunks chunk_size=16 p_attention=0.5"
    meta = config.oryx
    assert (meta["family"], meta["iteration"], meta["tokens_trained"], meta["model"]["vocab_size"]) == \
        ("oryx_tg", 20, 20 * 8 * 64, 257)
    assert meta["run"]["checkpoint"]["dir"] is None and "parallel" not in meta["run"]  # no paths, no layout
    tokenizer = AutoTokenizer.from_pretrained(exported)
    text = "héllo\n\tdef f(x): ✓"
    assert tokenizer.encode(text, add_special_tokens=False) == ByteTokenizer().encode_batch([text])[0].tolist()
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == tokenizer.pad_token_id == EOD
    generation = json.loads((exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOD and generation["suppress_tokens"] == list(range(257, PADDED))
    card = (exported / "README.md").read_text()
    assert "| family | oryx_tg (attention+gdn) |" in card and "| tokens trained | 10,240 |" in card


def test_export_config_records_document_resets(corpus, tmp_path):
    from oryx_megatron.interop.hf_convert import ConversionError, hf_config

    packed = run_config(corpus, tmp_path, "data.reset_at_eod=true")
    assert hf_config(packed.model, packed, eod_id=EOD).reset_at_eod_token_id == EOD
    assert hf_config(packed.model, run_config(corpus, tmp_path), eod_id=EOD).reset_at_eod_token_id is None
    with pytest.raises(ConversionError, match="data.reset_at_eod is true but no EOD token is known"):
        hf_config(packed.model, packed)


def test_heldout_losses_for_the_card(tmp_path):
    rows = [{"iteration": 10, "eval/loss_all_attention": 2.0, "eval/loss_all_linear": 2.5},
            {"iteration": 20, "train/loss": 1.0}, {"iteration": 30, "eval/loss_all_attention": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert heldout_losses(tmp_path / "metrics.jsonl", 20) == {"all_attention": 2.0, "all_linear": 2.5}


def test_generate_equals_oryx_generate(exported, tiny_checkpoint):
    """Greedy ``generate()`` of the loaded folder, with and without its cache, equals ``inference.generate`` (what
    oryx-generate runs) token for token, and the logits equal megatron's."""
    from transformers import AutoModelForCausalLM

    megatron, _ = load_model(tiny_checkpoint)
    hf = AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = ByteTokenizer().encode_batch([PROMPT])[0].tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        assert (hf(ids, modes="linear").logits - megatron(ids, torch.zeros_like(ids))).abs().max() <= 1e-5
    for schedule in ("all_attention", "prefill=linear decode=attention"):
        want = generate(megatron, [prompt], schedule, 16, vocab_size=257, stop_token_ids=[EOD]).tokens[0]
        for use_cache in (True, False):
            got = hf.generate(ids, schedule=schedule, max_new_tokens=16, do_sample=False, use_cache=use_cache)
            assert got[0, len(prompt):].tolist() == want, (schedule, use_cache)


def test_round_trip_is_bit_identical_and_oryx_eval_reads_it(tiny_checkpoint, imported, tmp_path, capsys):
    original, back = weights(tiny_checkpoint), weights(imported)
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    common = load_common(imported / "iter_0000000")
    assert common["iteration"] == 0 and common["layout"] == [1, 1, 1]
    rows = []
    for name, checkpoint in (("original", tiny_checkpoint), ("imported", imported)):
        cli(evaluate.main, checkpoint, "--task", "ppl", "--num-batches", "1", "--batch-size", "2",
            "--out", tmp_path / name)
        rows.append(json.loads((tmp_path / name / "ppl.json").read_text())["rows"])
    assert rows[0] == rows[1]


def test_imported_checkpoint_trains_as_a_fresh_run_from_its_weights(corpus, tmp_path):
    """megatron (a run's initial weights) -> HF -> megatron, resumed by oryx-train: the same losses as the run
    itself, exactly (fresh optimizer state, schedule and data order)."""
    from oryx_megatron.interop.hf_export import export_model
    from oryx_megatron.interop.hf_import import import_checkpoint
    from oryx_megatron.models.builder import build_model
    from oryx_megatron.parallel import initialize_parallel
    from oryx_megatron.training.loop import pretrain
    from oryx_megatron.training.builders import model_config

    run = run_config(corpus, tmp_path / "fresh", "train.train_iters=3")
    assert pretrain(run, str(tmp_path / "fresh_out")) == 0
    initialize_parallel(seed=run.train.seed)
    export_model(build_model(run.model, model_config(run)), run, tmp_path / "hf")  # the run's initial weights
    import_checkpoint(tmp_path / "hf", tmp_path / "imported")
    resumed = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, dir=str(tmp_path / "imported")))
    assert pretrain(resumed, str(tmp_path / "resumed_out")) == 0
    fresh = losses(tmp_path / "fresh_out")
    assert len(fresh) == 3 and losses(tmp_path / "resumed_out") == fresh  # exact, not approximately


def test_transformer_round_trip_through_a_stock_llama_folder(corpus, single_process_parallel, tmp_path):
    from oryx_megatron.interop.hf_export import export_model
    from oryx_megatron.interop.hf_import import import_checkpoint
    from oryx_megatron.models.builder import build_model
    from oryx_megatron.training.builders import model_config

    run = run_config(corpus, tmp_path / "run", "model.family=transformer", "train.train_iters=2")
    model = build_model(run.model, model_config(run))
    export_model(model, run, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    import_checkpoint(tmp_path / "hf", tmp_path / "ckpt")
    want = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v)}
    got = weights(tmp_path / "ckpt")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_tp2_checkpoint_exports_the_same_files(tiny_checkpoint, exported, imported, tmp_path):
    cli(import_hf.main, "hf", exported, tmp_path / "tp2", "--tp", "2")
    assert load_common(tmp_path / "tp2" / "iter_0000000")["layout"] == [1, 2, 1]
    original, resharded = weights(tiny_checkpoint), weights(tmp_path / "tp2")
    assert all(torch.equal(original[k], resharded[k]) for k in original)
    for name, checkpoint in (("from_tp1", imported), ("from_tp2", tmp_path / "tp2")):
        cli(export_hf.main, "hf", checkpoint, tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "from_tp1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "from_tp2").iterdir()) == sorted(folder_files())
    assert all(filecmp.cmp(tmp_path / "from_tp1" / f, tmp_path / "from_tp2" / f, shallow=False) for f in files)
    assert filecmp.cmp(exported / "model.safetensors", tmp_path / "from_tp1" / "model.safetensors", shallow=False)


def test_sharded_bf16_export_loads_with_remote_code_alone(tiny_checkpoint, tmp_path):
    """In a fresh interpreter that never imports oryx_megatron.hf itself: trust_remote_code=True loads the
    sharded bf16 folder through its auto_map, the folder's own code, the SSM scalars in fp32."""
    out = tmp_path / "bf16"
    cli(export_hf.main, "hf", tiny_checkpoint, out, "--dtype", "bfloat16", "--max-shard-size", "100KB")
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("model-*.safetensors"))) > 1
    script = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM\n"
        f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)\n"
        "scalars = {p.dtype for n, p in m.named_parameters() if '.linear_mixer.' in n}\n"
        "print(type(m).__module__, m.dtype, scalars == {torch.float32})\n"
        f"torch.save(m(torch.tensor([{ByteTokenizer().encode_batch([PROMPT])[0].tolist()}])).logits, "
        f"{str(tmp_path / 'logits.pt')!r})\n"
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    module, dtype, fp32_scalars = done.stdout.split()
    assert (module.split(".")[0], module.split(".")[-1], dtype, fp32_scalars) == \
        ("transformers_modules", "modeling_oryx", "torch.bfloat16", "True")
    megatron, _ = load_model(tiny_checkpoint, torch.bfloat16)
    ids = torch.tensor([ByteTokenizer().encode_batch([PROMPT])[0].tolist()])
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), megatron(ids, torch.ones_like(ids)))


def test_lm_eval_hf_backend_gives_the_adapters_loglikelihoods(exported, tiny_checkpoint, tmp_path):
    import lm_eval
    import lm_eval.models.huggingface  # noqa: F401  (registers lm-eval's "hf" backend)
    from lm_eval.tasks import TaskManager

    importlib.import_module("oryx_megatron.eval.lm_eval_harness")  # registers the adapter as lm-eval's "oryx"
    from tests.test_lm_eval_adapter import DOCS

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "oryx_code_mc.yaml").write_text(
        "task: oryx_code_mc\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {tmp_path / 'hf_cache'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: choices\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n")
    samples = {}
    for name, args in (("hf", f"pretrained={exported},trust_remote_code=True,dtype=float32,device=cpu"),
                       ("oryx", f"checkpoint={tiny_checkpoint},schedule=all_attention,device=cpu")):
        results = lm_eval.simple_evaluate(model=name, model_args=args, tasks=["oryx_code_mc"], batch_size=4,
                                          task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0,
                                          log_samples=True)
        samples[name] = sorted(results["samples"]["oryx_code_mc"], key=lambda s: s["doc_id"])
    hf = [[float(r[0]) for r in s["filtered_resps"]] for s in samples["hf"]]
    adapter = [[float(r[0]) for r in s["filtered_resps"]] for s in samples["oryx"]]
    assert len(hf) == len(DOCS) and all(len(row) == 3 for row in hf)
    assert max(abs(a - b) for x, y in zip(hf, adapter) for a, b in zip(x, y)) <= 1e-5


# --- bad input: one named line (exit 2), nothing left behind -------------------------------------------------

def error_line(main, args, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([str(a) for a in args])
    assert exit_.value.code == 2
    return capsys.readouterr().err.rstrip("\n").split("\n")[-1]


def test_export_of_a_path_that_is_not_a_checkpoint(tmp_path, capsys):
    assert error_line(export_hf.main, ["hf", tmp_path / "nope", tmp_path / "out"], capsys) == \
        f"oryx-export: error: checkpoint {tmp_path / 'nope'}: no such directory"
    (tmp_path / "empty").mkdir()
    assert error_line(export_hf.main, ["hf", tmp_path / "empty", tmp_path / "out"], capsys) == \
        (f"oryx-export: error: checkpoint {tmp_path / 'empty'} is neither a checkpoint (no run_config.yaml) "
         f"nor a checkpoint dir with 'latest'")
    assert not (tmp_path / "out").exists()


def test_import_of_another_model_type(tmp_path, capsys):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 64}))
    assert error_line(import_hf.main, ["hf", tmp_path / "gpt2", tmp_path / "ckpt"], capsys) == \
        (f"oryx-import: error: {tmp_path / 'gpt2' / 'config.json'}: model_type 'gpt2' is not an Oryx model "
         f"('oryx') or an exported Transformer ('llama')")
    assert not (tmp_path / "ckpt").exists()


def test_import_of_a_resized_vocab(exported, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    model.resize_token_embeddings(512)  # e.g. tokens added for fine-tuning
    model.save_pretrained(tmp_path / "resized")
    assert error_line(import_hf.main, ["hf", tmp_path / "resized", tmp_path / "ckpt"], capsys) == \
        (f"oryx-import: error: {tmp_path / 'resized' / 'config.json'}: vocab_size=512 does not match the "
         f"recipe's padded vocab 384 (model.vocab_size=257, make_vocab_size_divisible_by=128 in oryx.model): "
         f"the embedding was resized after export")
    assert not (tmp_path / "ckpt").exists()


def test_the_rest_of_the_package_imports_without_transformers(tmp_path):
    script = (
        "import sys\n"
        "sys.modules['transformers'] = None  # not installed\n"
        "import oryx_megatron.cli.train, oryx_megatron.eval.ppl, oryx_megatron.cli.generate\n"
        "from oryx_megatron.cli import export_hf\n"
        f"export_hf.main(['hf', {str(tmp_path)!r}, {str(tmp_path / 'out')!r}])\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.rstrip("\n").split("\n")[-1].startswith(
        "oryx-export: error: needs transformers and safetensors: pip install 'oryx-megatron[hf]'")
