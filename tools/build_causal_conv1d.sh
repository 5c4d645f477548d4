#!/usr/bin/env bash
# Build causal-conv1d 1.7.0 as a cp312 wheel for the GPU machine we are lent (one H200, sm_90; Python 3.12,
# torch 2.11.0+cu130, no network), with this machine's nvcc (CUDA 13.0): SASS for sm_90 only, no PTX.
#   tools/build_causal_conv1d.sh     # -> .gpu/whl/causal_conv1d-1.7.0+cu130torch2.11sm90-cp312-*.whl (9.1 MB)
# TORCH312_PY (default /tmp/v312/bin/python): a Python 3.12 with torch 2.11 cu13; only read (--no-build-isolation
# --no-deps). Measured here, 2 cores shared with other builds (load ~28), nice 19, MAX_JOBS=2: 16.5 min wall,
# 4.4 min CPU; a rerun compiles only what changed. Upstream's setup.py is patched: its hard-coded -gencode list
# (sm_75 ... sm_121) cut to sm_90; -lineinfo dropped (it embeds the PTX text: the backward cubin is 128 MB with
# it, 33 MB without; the wheel 25 MB with it); bdist_wheel taken from setuptools (no `wheel` package needed);
# CFLAGS=-g0 drops the host debug info. The toolkit under /usr/local/cuda lacks the cuBLAS/cuSPARSE/cuSOLVER
# headers that torch's CUDAContext.h includes: the interpreter's nvidia/cu13 wheels supply them (CPATH).
# On the GPU machine, from the checkout's root, tools/gpu_wheels.sh's install line installs it too:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl \
#     && export PYTHONPATH=$PWD:$PWD/.gpu/site:/tmp/site
# Its .dist-info lands in /tmp/site, so importlib.metadata (ops/selection.py) reads 1.7.0+cu130torch2.11sm90.
set -euo pipefail
version=1.7.0
arch=90   # TORCH_CUDA_ARCH_LIST alone is not enough: torch adds no arch flags when setup.py gives -gencode
py=${TORCH312_PY:-/tmp/v312/bin/python}
root=$(cd "$(dirname "$0")/.." && pwd)
dest=$root/${1:-.gpu}/whl
work=${CC1D_WORK:-/tmp/causal-conv1d-build}   # sources and build/ (kept: a rerun compiles only what changed)
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

"$py" -c "import sys, torch; assert sys.version_info[:2] == (3, 12) and torch.__version__.startswith('2.11.') \
  and torch.version.cuda.startswith('13.'), f'{sys.executable}: need Python 3.12 + torch 2.11 cu13, got \
{sys.version.split()[0]} + torch {torch.__version__}'"
"$CUDA_HOME/bin/nvcc" --version | grep -q "release 13\." || { echo "$CUDA_HOME/bin/nvcc is not CUDA 13" >&2; exit 1; }
mkdir -p "$dest" "$work"   # .gpu/ is git-ignored (.gitignore)

src=$work/causal_conv1d-$version
[ -f "$work/causal_conv1d-$version.tar.gz" ] \
  || "$py" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "causal-conv1d==$version" -d "$work"
tar xzf "$work/causal_conv1d-$version.tar.gz" -C "$work"   # pristine setup.py (sources keep their mtimes)
"$py" - "$src/setup.py" "$arch" <<'EOF'
import sys
path, arch = sys.argv[1], sys.argv[2]
text = open(path).read()
edits = [("from wheel.bdist_wheel import", "from setuptools.command.bdist_wheel import"),
         ("    # HACK: The compiler flag", f'    cc_flag = ["-gencode", "arch=compute_{arch},code=sm_{arch}"]\n'
                                         "    # HACK: The compiler flag"),
         ('                    "-lineinfo",\n', "")]
for old, new in edits:
    assert text.count(old) == 1, f"{path}: expected one {old!r}: upstream changed, revisit the patch"
    text = text.replace(old, new)
open(path, "w").write(text)
EOF

purelib=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
start=$(date +%s)
rm -rf "$dest"/causal_conv1d-*.whl "$src"/build/lib.*   # relink always: ninja then recompiles what changed
(cd "$src" && CFLAGS=-g0 CPATH=$purelib/nvidia/cu13/include${CPATH:+:$CPATH} TORCH_CUDA_ARCH_LIST=9.0 \
  CAUSAL_CONV1D_FORCE_BUILD=TRUE CAUSAL_CONV1D_LOCAL_VERSION="cu130torch2.11sm$arch" MAX_JOBS=${MAX_JOBS:-2} \
  nice -n 19 "$py" -m pip wheel --no-build-isolation --no-deps -v -w "$dest" . > "$work/build.log" 2>&1) \
  || { tail -40 "$work/build.log" >&2; echo "build failed: $work/build.log" >&2; exit 1; }
echo "built in $(( ($(date +%s) - start) / 60 )) min: $(ls -sh "$dest"/causal_conv1d-"$version"*.whl)"
