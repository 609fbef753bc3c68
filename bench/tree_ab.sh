#!/usr/bin/env bash
# Side by side across two trees: copy the flash_cute package of git ref REF into _ab/NAME/
# (ignored; bring it to the device machine with carry ["_ab"]), then run any bench script there
# against it, beside the working tree's package, in separate processes of one device call:
#   bash bench/tree_ab.sh main            # -> _ab/main/flash_cute
#   cd bench && python varlen_workload.py --rounds 7                                  # tree
#   cd bench && PYTHONPATH=$PWD/../_ab/main:$PYTHONPATH python varlen_workload.py --rounds 7
# Alternate the two (A B A B) when the difference sought is near the machine's drift.
set -euo pipefail
ref=$1; name=${2:-${1//\//_}}
cd "$(git rev-parse --show-toplevel)"
rm -rf "_ab/$name"; mkdir -p "_ab/$name"
git archive "$ref" flash_cute | tar -x -C "_ab/$name"
echo "_ab/$name/flash_cute <- $(git rev-parse --short "$ref")"
