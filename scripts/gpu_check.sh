#!/usr/bin/env bash
# The GPU check: CUDA KV blocks between two GPU workers over UCX (docs/gpu.md).
#
#   bash scripts/gpu_check.sh [gpu_check args]    # e.g. --reps 1 --phases env,cluster,transfer
#
# Where torch sees no CUDA device it prints a SKIP line and exits 0, measuring and writing
# nothing. On a GPU machine it
#   1. installs the carried wheels (.whl/, made by scripts/gpu_wheels.sh) into $GPU_CHECK_SITE
#      and puts them on PYTHONPATH after this checkout's package (scripts/source_tree.sh),
#   2. checks the GPU stack imports (dask-cuda, distributed-ucxx, CuPy, transformers >= 5.24),
#   3. runs the GPU tests (pytest -m gpu: serializers on CUDA, blocks between two UCX workers),
#   4. runs the measurement (python -m daskflow_kv.bench.gpu_check) under a time limit, with
#      UCX printing its protocol tables (UCX_PROTO_INFO=y) to per-process logs,
#   5. copies the results to $OUT when set (a device call brings back what is there):
#      gpu_h200.json, gpu_check.log, gpu_pytest.log, ucx_proto.log.
# GPU_CHECK_BUDGET (s, default 330) bounds the measurement's phases; the whole script stays
# under ~9 minutes. GPU_CHECK_DRY_RUN=1 prints the steps instead of running them (tests).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
SITE="${GPU_CHECK_SITE:-/tmp/site}"
BUDGET="${GPU_CHECK_BUDGET:-330}"
PYTEST_LIMIT="${GPU_CHECK_PYTEST_TIMEOUT:-150}"
DRY="${GPU_CHECK_DRY_RUN:-0}"
RESULT="$ROOT/benchmarks/results/gpu_h200.json"
LOGS="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")"

step() {  # run a command, or show it in a dry run
  if [ "$DRY" = 1 ]; then echo "DRY-RUN: $*"; return 0; fi
  "$@"
}

if [ "$DRY" != 1 ]; then
  cuda="$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)"
  if [ "$cuda" != 1 ]; then
    echo "SKIP gpu_check: no CUDA device visible to torch ($PY); nothing measured, $RESULT left as it is"
    exit 0
  fi
fi

# 1. carried wheels; this checkout as the installed package would be (scripts/source_tree.sh:
# plugins/ and workflows/ mapped under daskflow_kv), run with -P so ./daskflow_kv does not shadow it
SRC="$(bash "$ROOT/scripts/source_tree.sh" "$LOGS/src")"
if compgen -G ".whl/*.whl" >/dev/null; then
  echo "[gpu_check] installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
  step "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || { echo "FAIL gpu_check: installing .whl/*.whl failed"; exit 1; }
  export PYTHONPATH="$SRC:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # dask-cuda and ucxx need `from cuda.core import Device` (cuda-core >= 0.5.1): carried as a fallback.
  if ! "$PY" -c 'from cuda.core import Device' 2>/dev/null && compgen -G ".whl/fallback/*.whl" >/dev/null; then
    echo "[gpu_check] the image's cuda-core is too old or missing: installing .whl/fallback"
    step "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      .whl/fallback/*.whl || { echo "FAIL gpu_check: installing .whl/fallback failed"; exit 1; }
  fi
else
  export PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}"
fi

# 2. the stack
if [ "$DRY" != 1 ]; then
  if ! "$PY" - <<'EOF'
import sys
missing = []
for mod in ("dask_cuda", "distributed_ucxx", "cupy", "ucxx", "rmm"):
    try:
        __import__(mod)
    except Exception as e:  # noqa: BLE001
        missing.append(f"{mod} ({type(e).__name__}: {e})")
import transformers
from packaging.version import Version
if Version(transformers.__version__) < Version("5.24"):
    missing.append(f"transformers >= 5.24 (found {transformers.__version__})")
if missing:
    print("FAIL gpu_check: missing " + "; ".join(missing) + " -- run scripts/gpu_wheels.sh and carry .whl")
    sys.exit(1)
import dask, distributed
print(f"[gpu_check] stack: dask {dask.__version__}, distributed {distributed.__version__}, transformers {transformers.__version__}")
EOF
  then exit 1; fi
fi

# UCX: protocol tables into one log per process; models built into a scratch cache.
export UCX_PROTO_INFO="${UCX_PROTO_INFO:-y}"
export UCX_LOG_FILE="${UCX_LOG_FILE:-$LOGS/ucx.%p.log}"
export DASKFLOW_KV_UCX_LOG_DIR="${DASKFLOW_KV_UCX_LOG_DIR:-$LOGS}"
export DASKFLOW_KV_CACHE="${DASKFLOW_KV_CACHE:-/tmp/daskflow-kv-cache}"
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

# 3. GPU tests (their failure is reported, the measurement still runs)
step timeout --signal=TERM --kill-after=15 "$PYTEST_LIMIT" "$PY" -P -m pytest -q -m gpu -p no:cacheprovider \
  tests/test_serialization.py tests/test_gpu_ucx.py 2>&1 | tee "$LOGS/gpu_pytest.log"
pytest_rc=${PIPESTATUS[0]}

# 4. the measurement
step timeout --signal=TERM --kill-after=30 "$((${BUDGET%.*} + 45))" "$PY" -P -m daskflow_kv.bench.gpu_check \
  --budget "$BUDGET" --out "$RESULT" --ucx-log-dir "$LOGS" "$@" 2>&1 | tee "$LOGS/gpu_check.log"
check_rc=${PIPESTATUS[0]}

# 5. results back
if [ -n "${OUT:-}" ] && [ "$DRY" != 1 ]; then
  cp -f "$RESULT" "$OUT/" 2>/dev/null
  cp -f "$LOGS/gpu_check.log" "$LOGS/gpu_pytest.log" "$OUT/" 2>/dev/null
  cat "$LOGS"/ucx.*.log 2>/dev/null | head -c 8000000 >"$OUT/ucx_proto.log"
fi
echo "[gpu_check] pytest rc=$pytest_rc, gpu_check rc=$check_rc (0 targets met, 2 a target missed, 1 a failure)"
[ "$pytest_rc" = 0 ] || [ "$DRY" = 1 ] || exit 1
exit "$check_rc"
