# Two entry points (see README): `make test` and `make demo`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: the CPU wheel lies on local disk; an unpinned
# resolve would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= offline

.PHONY: test demo venv clean

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
demo: venv
	test -f data/stdlib/manifest.json || $(VENV)/bin/oryx-prep tokenize --stdlib --out data/stdlib \
		--vocab-size 4096 --shard-size 4M --workers 2
	rm -rf runs/demo
	$(VENV)/bin/oryx-train hydra.run.dir=runs/demo checkpoint.dir=runs/demo/checkpoints

clean:
	rm -rf $(VENV) build *.egg-info
