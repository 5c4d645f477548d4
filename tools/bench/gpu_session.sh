#!/usr/bin/env bash
# What a GPU session measures, in one command that writes under $OUT as it goes (docs/gpu.md):
# the training-step benchmark at 130m (issue 12's targets), a profile of one layer of each
# family at 130m shapes (the top ops of a step, $OUT/profile/), the inference benchmark at 130m
# (issue 13's), the GPU check, then the training benchmark at 1.4b.
#   OUT=$OUT PY=python3 tools/bench/gpu_session.sh      # bare GPU machine, after docs/gpu.md's two set-up lines
#   OUT=/tmp/s tools/bench/gpu_session.sh --toy         # a CPU rehearsal at toy sizes (seconds)
# Each stage runs under its own time limit (STAGE_LIMIT seconds), so one that hangs leaves the rest
# their time; session.log says what ran, its exit status and its seconds.
set -u
OUT=${OUT:-runs/gpu_session}
PY=${PY:-.venv/bin/python}
LIMIT=${STAGE_LIMIT:-240}
export WANDB_MODE=offline
[ "${1:-}" = "--toy" ] && toy=1 || toy=0
if [ $toy = 0 ]; then export TORCHDYNAMO_DISABLE=0; fi  # FlexAttention compiles (block-sparse attention)
mkdir -p "$OUT"

stage() {
    local name=$1 start rc
    shift
    echo "== $name: $*" >> "$OUT/session.log"
    start=$(date +%s)
    timeout "$LIMIT" "$@" > "$OUT/$name.txt" 2>&1
    rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - start )) s" >> "$OUT/session.log"
}

if [ $toy = 1 ]; then
    train=(--model-size tiny --seq 256 --micro-batch 2 --repeats 2 --warmup 1)
    profile=(--model-size tiny --seq 256 --micro-batch 2 --repeats 1)
    infer=(--contexts 64 --batches 1 --new-tokens 4 --repeats 1)
    check=(--toy --sections kernels)
else
    train=(--model-size 130m --seq 2048 --micro-batch 8 --p-attention 1.0 0.5 0.1 --repeats 4)
    profile=(--model-size 130m --seq 2048 --micro-batch 8 --repeats 2)
    infer=(--model oryx_tg_130m --contexts 1024 4096 16384 --batches 1 8 64)
    check=()
fi
stage train_step "$PY" tools/bench/bench_train_step.py "${train[@]}" --json "$OUT/train_step.json"
stage profile "$PY" tools/bench/bench_train_step.py "${profile[@]}" --layers 1 --p-attention 0.5 \
    --families attn_only_oryx oryx_tm oryx_tg --profile "$OUT/profile" --json "$OUT/profile.json"
stage inference "$PY" tools/bench/bench_inference.py "${infer[@]}" --json "$OUT/inference.json"
stage gpu_check "$PY" -m oryx_megatron.tools.gpu_check "${check[@]}" --out "$OUT/gpu_check"
if [ $toy = 0 ]; then
    stage train_step_1_4b "$PY" tools/bench/bench_train_step.py --model-size 1_4b --seq 2048 --micro-batch 2 \
        --p-attention 1.0 0.5 0.1 --recompute none selective --repeats 3 --json "$OUT/train_step_1_4b.json"
fi
cat "$OUT/session.log"
