#!/usr/bin/env bash
# The test suite: sets up the environment if needed, then runs every test (slow ones too).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
exec python -m pytest -q "$@"
