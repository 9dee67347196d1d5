"""gen_cluster resets dask.config after each test to the copy distributed.utils_test took
when it was first imported: daskflow_kv.config must register its defaults before that, or
every test after a gen_cluster test in the session runs without them."""

import sys

assert "distributed.utils_test" not in sys.modules, "import daskflow_kv.config before distributed.utils_test"
import daskflow_kv.config  # noqa: E402 -- registers the daskflow-kv defaults
import distributed.utils_test  # noqa: E402 -- now takes its copy with them

assert daskflow_kv.config.NAMESPACE in distributed.utils_test.original_config
