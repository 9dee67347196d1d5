"""A local cluster started from a script's unguarded top level: one readable line, no Nanny wall."""

import subprocess
import sys
import textwrap

import pytest

from daskflow_kv.runtime.main_guard import GUARD, MainGuardError, _guarded, check_main_guard

README_EXAMPLE = """\
from daskflow_kv import Workflow
from daskflow_kv.runtime.cluster import embedded_runtime

wf = Workflow("review", system="You are a careful analyst.")
wf.context("report", "Sales rose; costs rose faster.")
wf.agent("optimist", "List the strengths.", reads=["report"])
with embedded_runtime(model="tiny-llama", n_workers=1) as rt:
    print(wf.run(mode="state", runtime=rt).agents["optimist"].text)
"""


def _script(tmp_path, body: str, name="analysis.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_readme_example_as_a_script_says_what_to_add(tmp_path):
    proc = _script(tmp_path, README_EXAMPLE)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("daskflow_kv.runtime.main_guard.MainGuardError: local_cluster() called at the top "
                           "level of analysis.py (line 7)")
    assert last.endswith(f"put that code under `{GUARD}`")
    assert proc.stderr.count("Traceback") == 1  # the script's own, raised before any worker started
    assert "Nanny" not in proc.stderr and "spawn" in last  # no "Nanny failed to start" wall
    assert proc.stdout == ""


def test_the_readme_example_under_the_guard_runs(tmp_path):
    """No false alarm: the same script with the guard starts its cluster (spawned workers
    re-import it) and runs the workflow."""
    lines = README_EXAMPLE.replace("n_workers=1", 'n_workers=1, dashboard_address=":0"').splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("with "))
    guarded = lines[:at] + [GUARD] + ["    " + line for line in lines[at:]]
    proc = _script(tmp_path, "\n".join(guarded) + "\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() and "MainGuardError" not in proc.stderr


def test_a_guarded_script_passes_the_check(tmp_path):
    """The check alone (no cluster): under the guard, directly or through a function, it is quiet."""
    proc = _script(tmp_path, """\
        from daskflow_kv.runtime.main_guard import check_main_guard

        def main():
            check_main_guard()
            print("ok in main()")

        if __name__ == "__main__":
            check_main_guard()
            main()
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok in main()\n"


def test_a_function_called_from_the_top_level_is_refused(tmp_path):
    proc = _script(tmp_path, """\
        from daskflow_kv.runtime.main_guard import check_main_guard

        def main():
            check_main_guard("a test cluster")

        main()
    """, name="job.py")
    assert proc.returncode == 1
    assert "MainGuardError: a test cluster called at the top level of job.py (line 6)" in proc.stderr


def test_the_prompt_of_python_i_is_not_the_script(tmp_path):
    """``python -i script.py``: what is typed at the prompt runs in __main__ too, but not from the file."""
    (tmp_path / "setup.py").write_text("x = 1\n")
    typed = "from daskflow_kv.runtime.main_guard import check_main_guard\ncheck_main_guard()\nprint('typed ok')\n"
    proc = subprocess.run([sys.executable, "-i", str(tmp_path / "setup.py")], input=typed, capture_output=True,
                          text=True, timeout=120)
    assert "typed ok" in proc.stdout and "MainGuardError" not in proc.stderr, proc.stderr


def test_fork_re_imports_nothing_and_is_not_refused(tmp_path):
    proc = _script(tmp_path, """\
        from daskflow_kv.runtime.main_guard import check_main_guard
        check_main_guard(start_method="fork")
        print("fine")
    """)
    assert proc.returncode == 0 and proc.stdout == "fine\n", proc.stderr


def test_a_spawned_child_re_importing_the_script_is_detected(tmp_path):
    """The child's side: the check refuses while the main module is re-run as __mp_main__."""
    proc = _script(tmp_path, """\
        import multiprocessing
        from daskflow_kv.runtime.main_guard import MainGuardError, check_main_guard

        if multiprocessing.current_process().name != "MainProcess":  # only in the child's re-import
            try:
                check_main_guard("a test cluster")
            except MainGuardError as e:
                print("child:", e, flush=True)

        def nothing():
            pass

        if __name__ == "__main__":
            p = multiprocessing.get_context("spawn").Process(target=nothing)
            p.start()
            p.join()
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("child: a test cluster was started while a worker process re-imported the main "
                                  "script")


@pytest.mark.parametrize("source, line, expected", [
    ('if __name__ == "__main__":\n    go()\n', 2, True),
    ("if '__main__' == __name__:\n    go()\n", 2, True),
    ('go()\nif __name__ == "__main__":\n    pass\n', 1, False),
    ('with ctx():\n    if __name__ == "__main__":\n        go()\n', 3, True),
    ('if __name__ == "__main__":\n    pass\nelse:\n    go()\n', 4, False),
    ('try:\n    go()\nexcept E:\n    pass\n', 2, False),
    ("x = 1\n", 7, None),  # no statement there: not judged
])
def test_guarded_reads_the_enclosing_statements(tmp_path, source, line, expected):
    path = tmp_path / "s.py"
    path.write_text(source)
    assert _guarded(str(path), line) is expected


def test_unreadable_source_is_not_judged(tmp_path):
    assert _guarded(str(tmp_path / "missing.py"), 1) is None
    (tmp_path / "bad.py").write_text("def (:\n")
    assert _guarded(str(tmp_path / "bad.py"), 1) is None


def test_this_test_run_is_not_refused():
    """pytest's own entry point is guarded (or a package __main__): the check lets clusters start."""
    check_main_guard()
    assert issubclass(MainGuardError, RuntimeError)
