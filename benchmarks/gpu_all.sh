#!/usr/bin/env bash
# Every GPU check and benchmark of plait, in order (about 15 minutes on one H100: two device calls).
#
#   bash benchmarks/gpu_all.sh          # on the GPU machine
#   bash benchmarks/gpu_all.sh --dry    # anywhere (CPU): each step in its smallest form
#
# Outputs go under $OUT (default ./gpu_out): gpu_all.log (what ran, when, exit codes),
# env.txt, one .txt per step and gpu_step.json. The GPU machine has no package registry:
# torchao comes from wheels/ in the repository root (see docs/gpu.md, "Bringing torchao"),
# installed with --no-index --no-deps so torch is never touched. Each step has its own
# time limit, and a failing step does not stop the later ones; the script's exit code is
# the number of failed steps (0: all passed). All steps take about 15 minutes on one
# H100, more than one device call allows: run them in two calls with ONLY, e.g.
#   ONLY="pytest_gpu gpu_step" bash benchmarks/gpu_all.sh
#   ONLY="attention eager_step offload" bash benchmarks/gpu_all.sh
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
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then
        log "skip $name (not in ONLY)"
        return
    fi
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

# 4. fused attention kernels: one layer's forward + backward, SDPA vs blockwise and ring
if [[ $DRY -eq 1 ]]; then
    step attention 120 "$PY" benchmarks/attention_gpu.py --tiny
else
    step attention 240 "$PY" benchmarks/attention_gpu.py
fi

# 5. plait's eager bf16 step against the plain loop (the mixed-precision path)
if [[ $DRY -eq 1 ]]; then
    step eager_step 120 "$PY" benchmarks/eager_step.py --device cpu --dim 32 --layers 2 \
        --heads 4 --vocab 256 --seq 32 --batch 2 --steps 2 --warmup 1
else
    step eager_step 180 "$PY" benchmarks/eager_step.py --device cuda --dtype bf16 --dim 2048 \
        --layers 16 --heads 16 --vocab 32000 --seq 2048 --batch 4 --steps 10 --warmup 3
fi

# 6. ZeRO-Offload: the 7B model on one GPU (issue 30's case)
if [[ $DRY -eq 1 ]]; then
    step offload 240 "$PY" benchmarks/offload.py --steps 1 --warmup 0
else
    step offload 300 "$PY" benchmarks/offload.py --device cuda --dim 4096 --layers 32 \
        --heads 32 --vocab 32000 --ffn 11008 --seq 2048 --batch 1 --accum 16 --dtype bf16 \
        --recompute full --peak-tflops 989 --steps 2 --warmup 1
fi

log "done: $FAILED step(s) failed"
exit "$FAILED"
