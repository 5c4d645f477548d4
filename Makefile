# Two entry points (see README): `make test` and `make demo`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: the CPU wheel lies on local disk; an unpinned
# resolve would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= offline

.PHONY: test venv clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info
