#!/usr/bin/env bash
# The main job: sets up the environment if needed, then runs the offline demo workflow.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec daskflow-kv demo "$@"
