# Two entry points (see README): `make test` and `make demo`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: the CPU wheel lies on local disk; an unpinned
# resolve would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= offline

.PHONY: test demo experiments venv clean

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

# The paper-claim experiments of docs/results.md (recipes/experiment/), in dependency order:
# E3 and the ablations reuse E2's runs. Outputs in runs/experiments/<name>/.
EXPERIMENTS := e1_retrieval e2_lm e3_mode_switch a1_shared_query a2_sequence_mixing
experiments: venv data/stdlib/manifest.json
	for e in $(EXPERIMENTS); do $(VENV)/bin/oryx-experiment $$e || exit 1; done

# The GPU check (docs/gpu.md): kernels, model, training, performance -> runs/gpu_check/report.{json,md}.
# Without CUDA a CPU dry run. Extra flags: make gpu-check ARGS="--toy --out /tmp/gc"; bare GPU machine: PY=python3.
gpu-check:
	$(PY) -m oryx_megatron.tools.gpu_check $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
