#!/usr/bin/env bash
# The GPU checks a change to the kernels needs, in one device call (about 5 minutes on an H200):
# the whole test suite with compiled kernels (a pytest process per module group at once, so the
# compiles overlap), then compute-sanitizer's three tools on every CUDA variant (three processes at once).
# On a machine with several GPUs the processes are spread over them (CUDA_VISIBLE_DEVICES).
# Usage (device tool): bash dev/gpu_checks.sh "$OUT" [tests|sanitize]   — logs land in the given folder.
# FS_GROUP_TIMEOUT: seconds a test group may run (default 500: on an H100 at 318da09 tests/test_lce_sliced.py
# compiled past 420 s beside the 16 other groups, then ran in 68 s warm; it is split in two groups since).
set -u
out=${1:-.}
export PYTHONPATH=$PWD/src
what=${2:-all}
# (addopts without -n: the image may lack pytest-xdist, and a GPU run is one process per group anyway)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$out/gpu.txt"
ngpu=$(wc -l < "$out/gpu.txt")
if [ "$what" != sanitize ]; then
groups=("tests/test_gpu.py tests/test_gpu_replay.py" "tests/test_forward.py" "tests/test_properties.py"
        "tests/test_backward.py tests/test_api.py" "tests/test_masked.py tests/test_cross_entropy.py tests/test_distributed.py"
        "tests/test_cuda.py tests/test_bench.py" "tests/test_cuda_build.py tests/test_snapshot.py tests/test_cache.py"
        "tests/test_compose.py" "tests/test_tp.py tests/test_tp_triton.py tests/test_tp_disagreeing_ranks.py tests/test_tp_dtensor.py"
        "tests/test_hf.py tests/test_hf_attention.py tests/test_hf_training.py" "tests/test_cpu_path.py tests/test_cpu_precision.py tests/test_cpu_loss.py"
        "tests/test_lce.py tests/test_lce_autograd.py" "tests/test_lce_sliced.py::test_sliced_matches_reference"
        "tests/test_lce_sliced.py --deselect=tests/test_lce_sliced.py::test_sliced_matches_reference" "tests/test_lce_skip.py tests/test_review_lce.py"
        "tests/test_ce_options.py" "tests/test_ce_one_program.py")
listed=" ${groups[*]} "
rest=""
for f in tests/test_*.py; do [[ $listed == *" $f "* ]] || rest="$rest $f"; done  # every other test file
[ -n "$rest" ] && groups+=("${rest# }")
i=0
for g in "${groups[@]}"; do
    # shellcheck disable=SC2086
    (CUDA_VISIBLE_DEVICES=$((i % ngpu)) timeout "${FS_GROUP_TIMEOUT:-500}" python3 -m pytest --device cuda $g -q -o addopts="--strict-markers" -p no:cacheprovider -rfEs --durations=5 > "$out/pytest_cuda_$i.txt" 2>&1
     echo "pytest rc=$?" >> "$out/pytest_cuda_$i.txt") &
    i=$((i + 1))
done
wait
fi
cat "$out"/pytest_cuda_*.txt > /tmp/fs_pytest_cuda.txt 2>/dev/null && rm -f "$out"/pytest_cuda_*.txt \
    && mv /tmp/fs_pytest_cuda.txt "$out/pytest_cuda.txt"  # one file: the device tool returns few
[ "$what" = tests ] && { grep -E "passed|failed|error|worst|rc=" "$out/pytest_cuda.txt"; exit 0; }
i=0
for t in memcheck racecheck synccheck; do
    args=(--tool "$t" --error-exitcode 1)
    small=()
    [ "$t" = memcheck ] && args+=(--report-api-errors no)  # cuda-bindings probes newer driver entry points
    [ "$t" = racecheck ] && small=(small)
    [ "$t" = synccheck ] && small=(synccheck)  # staged clusters capped at 8 there (heuristics/softmax_cuda.STAGE_CLUSTER_MAX)
    (CUDA_VISIBLE_DEVICES=$((i % ngpu)) timeout 150 compute-sanitizer "${args[@]}" python3 dev/sanitize_cuda.py "${small[@]}" > "$out/san_$t.txt" 2>&1
     echo "$t rc=$?" >> "$out/san_$t.txt") &
    i=$((i + 1))
done
wait
grep -E "passed|failed|error|worst|rc=" "$out/pytest_cuda.txt" 2>/dev/null; tail -n 3 "$out"/san_*.txt
