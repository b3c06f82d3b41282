#!/usr/bin/env bash
# One device call: the full GPU suite (after tuning), host-overhead profile, ncu of a long-row and
# a mid-row kernel. Usage: bash dev/session_a.sh "$OUT"
set -u
out=$1
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
timeout 345 python3 -m pytest --device cuda tests -q -p no:cacheprovider -rfE > "$out/pytest_cuda.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_cuda.txt"
{ for w in auto triton cuda bwd; do timeout 30 python3 dev/host_profile.py $w; done
  FASTSOFTMAX_FAST_LAUNCH=1 timeout 30 python3 dev/host_profile.py triton; } > "$out/host_profile.txt" 2>&1
sec=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis)
for v in "cuda cluster bfloat16 2048 65536" "triton online bfloat16 2048 65536" "cuda block bfloat16 32768 4096"; do
    echo "=== $v"
    timeout 60 ncu -k regex:'fs_|softmax' --launch-skip 3 --launch-count 1 "${sec[@]}" python3 dev/ncu_one.py $v 2>&1 | grep -v "^==PROF==" | tail -n 95
done > "$out/ncu.txt" 2>&1
tail -n 8 "$out/pytest_cuda.txt"
