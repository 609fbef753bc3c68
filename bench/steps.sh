#!/usr/bin/env bash
# Run named GPU steps one after another, each under its own time limit, logging to $OUT.
#   bash bench/steps.sh SECONDS "cmd one" SECONDS "cmd two" ...
# A step that hangs or fails is reported and the next one still runs, so one device call can
# carry several checks and timings (the device time is the scarce resource).
out=${OUT:-/tmp/out}; mkdir -p "$out"; n=0
while [ $# -ge 2 ]; do
  n=$((n + 1)); limit=$1; cmd=$2; shift 2
  echo "=== step $n (${limit}s): $cmd" | tee -a "$out/steps.log"
  start=$(date +%s)
  timeout -k 5 "$limit" bash -c "$cmd" > "$out/step$n.log" 2>&1; rc=$?
  tail -n 40 "$out/step$n.log"
  echo "=== step $n rc=$rc in $(( $(date +%s) - start ))s" | tee -a "$out/steps.log"
done
