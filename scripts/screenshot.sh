#!/usr/bin/env bash
# Screenshot of the Dask dashboard's KV page after a demo run -> docs/kv-dashboard.png
#
#   bash scripts/screenshot.sh [OUT.png]
#
# Starts an embedded cluster (2 workers, tiny-llama: no weights to convert), runs the RAG
# workflow in state mode with a cost model that favours moving KV (so transfers show up),
# keeps a second family of states live, lowers the KV budget so some blocks are evicted,
# then renders http://HOST:PORT/kv in headless Chromium (Debian's package, installed here
# if missing). DASKFLOW_KV_PYTHON=/path/to/python skips the project venv set-up.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/docs/kv-dashboard.png}"
if [ -n "${DASKFLOW_KV_PYTHON:-}" ]; then
  PY="$DASKFLOW_KV_PYTHON"
else
  # shellcheck disable=SC1091
  source "$ROOT/scripts/env.sh"
  PY=python
fi
if ! command -v chromium >/dev/null 2>&1; then
  echo "[screenshot] installing Debian's chromium"
  apt-get update -qq && apt-get install -y -qq chromium fonts-dejavu-core fonts-liberation >/dev/null
fi
mkdir -p "$(dirname "$OUT")"
TMP="$(mktemp -d)"
SERVER_PID=""
cleanup() {
  touch "$TMP/url.done"
  if [ -n "$SERVER_PID" ]; then wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
}
trap cleanup EXIT

cat >"$TMP/kv_demo.py" <<'PY'
import os
import sys
import time
import urllib.parse


def main(url_file: str, hold_s: float = 300.0) -> None:
    from daskflow_kv.policy.cost_model import PrefillProfile
    from daskflow_kv.plugins.dashboard import KVDashboardPlugin
    from daskflow_kv.runtime.cluster import embedded_runtime
    from daskflow_kv.workflows import WORKFLOWS

    with embedded_runtime(n_workers=2, model="tiny-llama", block_size=16, dashboard_address="127.0.0.1:0") as rt:
        rt.client.register_plugin(KVDashboardPlugin())
        # what-if numbers: slow prefill, fast links, so the planner moves KV across workers
        rt.prefill_override = PrefillProfile(0.0, 2e-3, 0.0)
        rt.bandwidth_override = 2e9
        wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=8, agents=3)
        result = wf.run(mode="state", runtime=rt)
        for name, a in result.agents.items():
            print(f"  {name:<12} {a.decision:<9} on {a.worker}: reused {a.tokens_reused}, computed {a.tokens_computed}",
                  flush=True)
        for _ in range(4):  # a few more runs, a sample apart, for the live plots to draw lines
            time.sleep(2.2)
            wf.run(mode="state", runtime=rt)
        # a second family kept live (the workflow released its own states at the end)
        root = rt.materialize("Notes kept live for the page: these KV states still hold their blocks. " * 3)
        kids = rt.fork(root, 2)
        rt.resume_many([(kids[0], rt.encode(" First question?")), (kids[1], rt.encode(" A second, longer question?"))],
                       4)
        used = max(rt.counters()["kv_bytes"].values())
        rt.configure(kv_budget_bytes=int(used * 0.7))  # cached blocks of released states get evicted
        time.sleep(2.0)
        port = urllib.parse.urlsplit(rt.client.dashboard_link).port
        base = f"http://127.0.0.1:{port}"  # the dashboard is bound to loopback
        with open(url_file + ".tmp", "w") as f:
            f.write(base + "\n")
        os.replace(url_file + ".tmp", url_file)
        t0 = time.time()
        while time.time() - t0 < hold_s and not os.path.exists(url_file + ".done"):
            time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
PY

echo "[screenshot] starting a cluster and running the rag workflow"
(cd "$ROOT" && TOKENIZERS_PARALLELISM=false "$PY" "$TMP/kv_demo.py" "$TMP/url") &
SERVER_PID=$!
for _ in $(seq 300); do
  [ -f "$TMP/url" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { echo "[screenshot] the demo cluster exited early" >&2; exit 1; }
  sleep 1
done
[ -f "$TMP/url" ] || { echo "[screenshot] the demo cluster did not come up" >&2; exit 1; }
URL="$(cat "$TMP/url")/kv"
echo "[screenshot] $URL -> $OUT"
timeout 120 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$TMP/chromium" --hide-scrollbars --window-size="${KV_SHOT_SIZE:-1400,2300}" \
  --virtual-time-budget=5000 --screenshot="$OUT" "$URL" 2>"$TMP/chromium.log" \
  || { cat "$TMP/chromium.log" >&2; exit 1; }
ls -l "$OUT"
