#!/usr/bin/env bash
# Prints a folder that imports as the installed package from this checkout, for machines
# where the project is not pip-installed (the lent GPU machine: no package index there).
#
#   PYTHONPATH="$(bash scripts/source_tree.sh):$PYTHONPATH" python -P -m ...
#
# The design card keeps plugins/ and workflows/ at the top of the repository and
# pyproject.toml's package-dir installs them as daskflow_kv.plugins and
# daskflow_kv.workflows. This builds the same mapping as setuptools' strict editable mode: a
# tree of symbolic links to the real files (edits show through; no copy). Run Python with
# -P (or from another folder) so the checkout's own daskflow_kv/ does not shadow it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-${TMPDIR:-/tmp}/daskflow-kv-src}"
rm -rf "$DEST"
mkdir -p "$DEST"
cp -rs "$ROOT/daskflow_kv" "$DEST/daskflow_kv"
ln -s "$ROOT/plugins" "$DEST/daskflow_kv/plugins"
ln -s "$ROOT/workflows" "$DEST/daskflow_kv/workflows"
echo "$DEST"
