# ncu metrics of the N = 513 rows (bf16 79% of copy, fp32 98%) against 131072x1024: instructions, requests, DRAM bytes.
# Usage (device): bash dev/ncu_513.sh > OUT/ncu_513.txt
export PYTHONPATH=$PWD/src
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,launch__registers_per_thread,launch__grid_size,launch__block_size"
for c in "triton rowblock bfloat16 262144 513 fwd" "cuda warp bfloat16 262144 513 fwd" "triton rowblock float32 262144 513 fwd" "triton rowblock bfloat16 131072 1024 fwd" "triton rowblock bfloat16 262144 513 bwd"; do
  echo "=== $c"
  timeout 60 ncu -k regex:'fs_|softmax' --launch-skip 3 --launch-count 1 --metrics $M python3 dev/ncu_one.py $c 2>&1 | grep -E "^\s+(gpu__|dram__|sm__|smsp__|l1tex__|launch__)|Plan"
done
