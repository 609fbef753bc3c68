#!/usr/bin/env bash
# Per-instruction warp-stall sampling (ncu SourceCounters) of ours and FA4 side by side, for
# bench/stall_table.py:   OUT=dir bash bench/prof_src.sh NAME [prof_pair.py args...]
# Writes NAME.ncu-rep, NAME_src.csv (ncu's source page: one row per SASS instruction) and
# NAME_details.csv (per-kernel sections, incl. the stall-reason breakdown).
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"; name=$1; shift
ncu --profile-from-start off --section SourceCounters --section WarpStateStats \
    --section SpeedOfLight --clock-control none -f -o "$out/$name" \
    python bench/prof_pair.py "$@"
ncu -i "$out/$name.ncu-rep" --page source --csv --print-source sass > "$out/${name}_src.csv"
ncu -i "$out/$name.ncu-rep" --page details --csv > "$out/${name}_details.csv"
ls -la "$out"
