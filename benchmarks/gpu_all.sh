#!/usr/bin/env bash
# Every GPU figure of plait in two device calls: a thin wrapper of benchmarks/gpu_all.py
# (its docstring and docs/gpu.md say what each row measures, its budget and limit).
#
#   bash benchmarks/gpu_all.sh --call 1    # on the GPU machine, first call (carry wheels/)
#   bash benchmarks/gpu_all.sh --call 2    # second call; a rerun skips rows already in $OUT
#   bash benchmarks/gpu_all.sh --dry       # anywhere (CPU): every row in its smallest form
#
# Budgets (s): call 1 = 197 + preflight, call 2 = 213 (7 minutes of work in all);
# outputs under $OUT (default gpu_out/): rows.jsonl, table.md, one <row>.txt per row.
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "${PYTHON:-python}" "$ROOT/benchmarks/gpu_all.py" "$@"
