"""docs/reliability.md's table is the rendering of the scenario JSONs committed beside it."""

import re

from daskflow_kv.bench.reliability_table import DOC, MARKERS, render


def test_the_committed_table_is_the_rendering_of_the_results():
    text = DOC.read_text()
    block = re.search(re.escape(MARKERS[0]) + r"\n(.*?)\n" + re.escape(MARKERS[1]), text, re.DOTALL)
    assert block, "docs/reliability.md lost its markers"
    assert block.group(1) == render(), "run: python -m daskflow_kv.bench.reliability_table"


def test_a_scenario_without_its_json_says_not_run(tmp_path):
    assert all("not run" in line for line in render(tmp_path).splitlines()[2:])
