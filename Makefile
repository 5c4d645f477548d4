# Two entry points (see README): `make test` and `make demo`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: the CPU wheel lies on local disk; an unpinned
# resolve would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= offline

.PHONY: test demo experiments experiments-large venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

# The main job on the embedded default: tokenize the Python standard library, train the tiny
# Oryx-TG for a few minutes on CPU, evaluate per-mode held-out loss, plot the loss curve.
demo: venv data/stdlib/manifest.json
	rm -rf runs/demo
	$(VENV)/bin/oryx-train hydra.run.dir=runs/demo checkpoint.dir=runs/demo/checkpoints

# The embedded corpus: the Python standard library, byte-level BPE with 4096 tokens.
data/stdlib/manifest.json: | venv
	$(VENV)/bin/oryx-prep tokenize --stdlib --out data/stdlib --vocab-size 4096 --shard-size 4M --workers 2

# The paper-claim experiments of docs/results.md (recipes/experiment/), in dependency order
# (E3 evaluates E1's runs; NIAH and the ablations E2's). Outputs in runs/experiments/<name>/.
# `experiments`: the sizes a 2-core CPU runs in ~3 h; `experiments-large`: the issue's E1
# sizes (4 layers, 256 tokens; ~16 h on 2 CPU cores: a GPU's job).
EXPERIMENTS := e1_retrieval_small e1_retrieval_small_16pairs e3_mode_switch_small e2_lm niah a1_shared_query a3_kv_gate
EXPERIMENTS_LARGE := e1_retrieval e1_retrieval_8pairs e3_mode_switch a2_sequence_mixing
experiments: venv data/stdlib/manifest.json
	for e in $(EXPERIMENTS); do $(VENV)/bin/oryx-experiment $$e || exit 1; done
experiments-large: venv
	for e in $(EXPERIMENTS_LARGE); do $(VENV)/bin/oryx-experiment $$e || exit 1; done

# The GPU check (docs/gpu.md): kernels, model, training, performance -> runs/gpu_check/report.{json,md}.
# Without CUDA a CPU dry run. Extra flags: make gpu-check ARGS="--toy --out /tmp/gc"; bare GPU machine: PY=python3.
gpu-check:
	$(PY) -m oryx_megatron.tools.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
