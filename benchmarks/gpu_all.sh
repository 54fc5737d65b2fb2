#!/usr/bin/env bash
# Every GPU check and benchmark of plait, in order, in one go (about 9 minutes on one H100).
#
#   bash benchmarks/gpu_all.sh          # on the GPU machine
#   bash benchmarks/gpu_all.sh --dry    # anywhere (CPU): each step in its smallest form
#
# Outputs go under $OUT (default ./gpu_out): gpu_all.log (what ran, when, exit codes),
# env.txt, one .txt per step and gpu_step.json. The GPU machine has no package registry:
# torchao comes from wheels/ in the repository root (see docs/gpu.md, "Bringing torchao"),
# installed with --no-index --no-deps so torch is never touched. Each step has its own
# time limit, and a failing step does not stop the later ones; the script's exit code is
# the number of failed steps (0: all passed).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DRY=0
[[ "${1:-}" == "--dry" ]] && DRY=1
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python}"
FAILED=0
cd "$ROOT" || exit 1

log() { echo "[gpu_all $(date -u +%H:%M:%S)] $*" | tee -a "$OUT/gpu_all.log"; }

# step NAME LIMIT_S CMD...: run CMD with a time limit, output to $OUT/NAME.txt
step() {
    local name=$1 limit=$2
    shift 2
    log "start $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local rc=$?
    log "end $name: exit $rc after $((SECONDS - t0))s"
    tail -n 25 "$OUT/$name.txt"
    [[ $rc -eq 0 ]] || FAILED=$((FAILED + 1))
}

log "plait gpu_all (dry=$DRY) in $ROOT, outputs in $OUT"
{
    date -u
    nvidia-smi 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c 'import torch, sys; print("python", sys.version.split()[0]); print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", torch.cuda.get_device_capability(0) if torch.cuda.is_available() else "")'
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# 1. torchao from the carried wheels (no registry on the GPU machine; never upgrade torch)
if "$PY" -c 'import torchao' 2>/dev/null; then
    log "torchao already importable: $("$PY" -c 'import torchao; print(torchao.__version__)')"
elif compgen -G "$ROOT/wheels/torchao-*.whl" >/dev/null; then
    if [[ $DRY -eq 1 ]]; then
        log "dry: would install $(ls "$ROOT"/wheels/torchao-*.whl)"
    else
        step install_torchao 120 "$PY" -m pip install --no-index --no-deps --find-links "$ROOT/wheels" torchao
    fi
else
    log "no wheels/torchao-*.whl: the float8 rows and tests will be skipped (docs/gpu.md says how to bring it)"
fi

# 2. the GPU tests (compile, float8, CUDA blockwise kernels, memory snapshot, ...)
if [[ $DRY -eq 1 ]]; then
    step pytest_gpu 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu --collect-only tests
else
    step pytest_gpu 240 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests
fi

# 3. issue 28's table: plait eager / compiled / compiled + float8 vs the plain loops
if [[ $DRY -eq 1 ]]; then
    step gpu_step 300 "$PY" benchmarks/gpu_step.py --device cpu --tiny --steps 1 --warmup 0 \
        --peak-tflops 1 --json "$OUT/gpu_step.json"
else
    step gpu_step 330 "$PY" benchmarks/gpu_step.py --device cuda --steps 10 --warmup 3 \
        --json "$OUT/gpu_step.json"
fi

# 4. placeholders the lead extends (each a `step NAME LIMIT CMD...` line like the above)
log "placeholder: attention kernels benchmark (blockwise/ring/Ulysses vs SDPA) goes here"
log "placeholder: offload benchmark goes here"

log "done: $FAILED step(s) failed"
exit "$FAILED"
