#!/usr/bin/env bash
# Side by side across trees: copy git ref REF's package, tests and bench scripts into
# _ab/NAME/ (ignored; bring it to the device machine with carry ["_ab"]), then time or test it
# beside the working tree, in separate processes of one device call:
#   bash bench/tree_ab.sh main            # -> _ab/main/{flash_cute,tests,bench}
#   cd bench && python varlen_workload.py --rounds 7                                  # tree
#   cd bench && PYTHONPATH=$PWD/../_ab/main:$PYTHONPATH python varlen_workload.py --rounds 7
#   cd _ab/main && CUTE_DSL_CACHE_DIR=/tmp/cache-main python -m pytest -q -m gpu tests/...
# (python -m puts the current directory, so that tree's package, ahead of PYTHONPATH; give each
# tree a kernel cache of its own). Alternate the trees (A B A B) when the difference sought
# is near the machine's drift.
set -euo pipefail
ref=$1; name=${2:-${1//\//_}}
cd "$(git rev-parse --show-toplevel)"
rm -rf "_ab/$name"; mkdir -p "_ab/$name"
git archive "$ref" flash_cute tests bench setup.cfg pyproject.toml | tar -x -C "_ab/$name"
echo "_ab/$name/{flash_cute,tests,bench} <- $(git rev-parse --short "$ref")"
