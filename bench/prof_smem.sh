#!/usr/bin/env bash
# Shared-memory bank, L2 and tensor-pipe utilization of ours vs FA4 (is the backward bound by
# shared memory, or by L2: Q / dO reads and dQ reduce-adds per key block?):
#   OUT=dir bash bench/prof_smem.sh NAME [prof_pair.py args...]
set -u
out=${OUT:-/tmp/out}; mkdir -p "$out"; name=$1; shift
m=l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed
m=$m,l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed
m=$m,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
m=$m,l1tex__data_bank_reads.sum,l1tex__data_bank_writes.sum
m=$m,sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_elapsed
m=$m,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum
m=$m,lts__t_sectors_op_read.sum,lts__t_sectors_op_red.sum,lts__t_sectors_op_write.sum
m=$m,dram__throughput.avg.pct_of_peak_sustained_elapsed
m=$m,sm__cycles_elapsed.max,smsp__inst_executed.sum
ncu --profile-from-start off --metrics "$m" --clock-control none --csv \
    python bench/prof_pair.py "$@" > "$out/${name}_smem.csv"
grep -E "Sm90|Backward|Forward" "$out/${name}_smem.csv" | grep -v -E "pre|post|Pre|Post" \
    | awk -F'","' '{print substr($5,1,60), $(NF-2), $NF}'
