"""TLS end to end from daskflow-kv's own entry points: every connection is tls://."""

import subprocess
import sys

import pytest

pytest.importorskip("cryptography")

from distributed import Security  # noqa: E402

from daskflow_kv.flow.executor import Comparison, run_state_mode, run_text_mode  # noqa: E402
from daskflow_kv.runtime.cluster import embedded_runtime  # noqa: E402
from daskflow_kv.workflows import WORKFLOWS  # noqa: E402


def test_a_workflow_over_tls_agrees_with_text_mode():
    security = Security.temporary()
    with embedded_runtime(n_workers=2, model="tiny-llama", block_size=16, security=security) as rt:
        info = rt.client.scheduler_info(n_workers=-1)
        assert info["address"].startswith("tls://")
        assert info["workers"] and all(w.startswith("tls://") for w in info["workers"])
        wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=6, agents=3)
        compile_ = lambda: wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)  # noqa: E731
        cmp = Comparison(run_state_mode(compile_(), rt), run_text_mode(compile_(), rt))
        assert cmp.all_agree, cmp.agreement
        assert sum(cmp.state.level_tokens_computed) < sum(cmp.text.level_tokens_computed)


def test_the_cli_runs_a_workflow_over_tls():
    out = subprocess.run([sys.executable, "-m", "daskflow_kv.cli", "run", "rag", "--model", "tiny-llama", "--agents",
                          "2", "--max-new-tokens", "4", "--context-tokens", "128", "--tls"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "workers x 1 thread, TLS" in out.stdout
    assert "token agreement: 3/3 agents identical" in out.stdout  # two readers and the synthesizer


@pytest.mark.parametrize("flags, message", [
    (["--tls-cert", "README.md"], "--tls-cert and --tls-key go together"),
    (["--tls", "--scheduler", "tls://127.0.0.1:1"], "--tls starts a TLS local cluster"),
    (["--tls-ca-file", "/nonexistent.pem"], "is not an existing file"),
])
def test_tls_flags_fail_fast(flags, message):
    out = subprocess.run([sys.executable, "-m", "daskflow_kv.cli", "run", "rag", *flags], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
