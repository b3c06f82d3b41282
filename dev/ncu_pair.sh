# ncu metrics of fastsoftmax auto and QuACK on the same problems (dev/ncu_pair.py), at the real clock.
# Usage (device; QuACK from dev/peers.sh install): bash dev/ncu_pair.sh fastsoftmax|quack > OUT/ncu_pair.txt
export PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD/src
M="gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_read.sum,lts__t_sectors_op_write.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum,launch__grid_size,launch__block_size,launch__cluster_dim_x,launch__registers_per_thread,launch__shared_mem_per_block_dynamic"
for c in "bfloat16 2048 65536" "bfloat16 4096 32768" "float32 2048 65536" "bfloat16 64 131072"; do
  echo "=== $1 $c fwd"
  timeout 90 ncu --clock-control none --profile-from-start off --metrics $M python3 dev/ncu_pair.py $1 $c fwd 2>&1 \
    | grep -E "^\s+(gpu__|dram__|lts__|sm__|smsp__|launch__)|^  [A-Za-z_].*\(" | cut -c1-120
done
