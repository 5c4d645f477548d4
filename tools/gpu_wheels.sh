#!/usr/bin/env bash
# Fill the git-ignored .gpu/ of the checkout with what a bare GPU machine (Python 3.12, torch 2.11 cu130,
# Triton 3.6, einops, numpy, tokenizers, matplotlib, pyarrow, psutil, tqdm, pytest; no network) lacks:
# cp312 wheels (megatron-core 0.19.2, the release `make test-py312` tests on Python 3.12; fla-core, Hydra, ...)
# and mamba-ssm's Python sources (it ships as source only: its Triton ops are pure Python, so its package is
# copied with an __init__ that imports nothing). docs/gpu.md, "On a bare GPU machine".
#   tools/gpu_wheels.sh            # -> .gpu/whl (wheels) and .gpu/site (mamba_ssm), ~5 MB
# Then, on the GPU machine, from the checkout's root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
#     && export PYTHONPATH=$PWD:$PWD/.gpu/site:/tmp/site
set -euo pipefail
dest=${1:-.gpu}
mkdir -p "$dest/whl" "$dest/site"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d "$dest/whl" megatron-core==0.19.2 fla-core==0.6.0 hydra-core==1.3.8 omegaconf==2.3.1 webdataset==1.0.2 \
  braceexpand==0.1.7 submitit hydra-submitit-launcher==1.2.0 cloudpickle
python3 -m pip wheel -q --no-deps -w "$dest/whl" antlr4-python3-runtime==4.9.3   # sdist only; pure Python
if [ ! -d "$dest/site/mamba_ssm" ]; then
  tmp=$(mktemp -d)
  # the sdist's metadata step imports torch: a venv that has it
  py=${TORCH_PY:-.venv/bin/python}
  MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$py" -m pip download -q --no-deps --no-build-isolation \
    mamba-ssm==2.3.2.post1 -d "$tmp"
  tar xzf "$tmp"/mamba_ssm-*.tar.gz -C "$tmp"
  cp -r "$tmp"/mamba_ssm-*/mamba_ssm "$dest/site/"
  echo '__version__ = "2.3.2.post1"  # Triton ops only: nothing imported here' > "$dest/site/mamba_ssm/__init__.py"
  rm -rf "$tmp"
fi
du -sh "$dest"
