#!/usr/bin/env bash
# The GPU checks a change to the kernels needs, in one device call (about 6 minutes on an H200):
# the whole test suite with compiled kernels, then compute-sanitizer's three tools on every CUDA variant.
# Usage (device tool): bash dev/gpu_checks.sh "$OUT"   — logs land in the given folder.
set -u
out=${1:-.}
export PYTHONPATH=$PWD/src
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt"
timeout 330 python3 -m pytest --device cuda tests -q -p no:cacheprovider -rfE > "$out/pytest_cuda.txt" 2>&1
echo "pytest rc=$?" >> "$out/pytest_cuda.txt"
for t in memcheck racecheck synccheck; do
    args=(--tool "$t" --error-exitcode 1)
    small=()
    [ "$t" = memcheck ] && args+=(--report-api-errors no)  # cuda-bindings probes newer driver entry points
    [ "$t" = racecheck ] && small=(small)
    timeout 100 compute-sanitizer "${args[@]}" python3 dev/sanitize_cuda.py "${small[@]}" > "$out/san_$t.txt" 2>&1
    echo "$t rc=$?" >> "$out/san_$t.txt"
done
tail -n 3 "$out"/pytest_cuda.txt "$out"/san_*.txt
