#!/usr/bin/env bash
# The checks that need a GPU (issues 34 and 44), in one run on a lent device, from the copied
# work tree with nothing to download (a lent device has no network; packages it lacks travel as
# wheels in .whl/, installed here offline), on whatever Python it has (kvpool from src/; where
# the compiled modules are not for this Python, the python backend runs, and the first lines
# say so). One summary line per check:
#   the Python, the packages, kvpool's backend, the GPU, pinning (a refusal, and the kernel after it);
#   the CUDA tests (every move verified byte for byte, staging buffers smaller than a slot, the
#   race with its window asserted and its negative controls, the reference engine and the
#   transformers cache on the device);
#   the device paths on the CPU stand-in (tests/fake_cuda.py: runs with or without a GPU);
#   the figures: host <-> GPU bandwidth against a plain pinned copy (goal >= 80%), adjust()
#   against its copy (goal <= 1.5x).
# Without a CUDA device the CUDA checks print "skipped" with the reason. Logs and JSON go to
# $OUT (or ./gpu-check). Exit status 0 when nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
out="${OUT:-gpu-check}"
mkdir -p "$out"
py="${PYTHON:-python3}"
status=0
say() { echo "gpu_check: $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
    site="$(mktemp -d)"
    if "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl >"$out/wheels.txt" 2>&1; then
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        say "wheels: $(compgen -G '.whl/*.whl' | wc -l) installed from .whl/ (offline)"
    else
        say "wheels: FAILED to install from .whl/ (see $out/wheels.txt)"
        status=1
    fi
fi
export PYTHONPATH="$root/src:$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

"$py" scripts/gpu_env.py "$out" 2>"$out/env-stderr.txt"
env_status=$?
cuda=0
case $env_status in
    0) cuda=1 ;;
    3) ;;
    *) status=1 ;;
esac

# tests NAME LIMIT FILES...: pytest, its log in $OUT/NAME.txt, its last line as the summary
tests() {
    local name=$1 limit=$2
    shift 2
    KVPOOL_DEBUG=1 timeout "$limit" "$py" -m pytest -q -rs -p no:cacheprovider "$@" \
        >"$out/$name.txt" 2>&1
    local rc=$?
    local last
    last=$(grep -E '(passed|failed|skipped|error|no tests ran)' "$out/$name.txt" | tail -n 1)
    if [ "$rc" -eq 0 ]; then
        say "$name: ${last:-ok}"
    else
        [ "$rc" -eq 124 ] && last="timed out after ${limit}s; $last"
        say "$name: FAILED (exit $rc): ${last:-see $out/$name.txt}"
        status=1
    fi
}

# bench NAME SCRIPT ARGS...: a benchmark's JSON in $OUT/NAME.json, its ratios as the summary
bench() {
    local name=$1 script=$2
    shift 2
    if timeout 240 "$py" "$script" "$@" >"$out/$name.json" 2>"$out/$name-stderr.txt"; then
        say "$name: $("$py" -c '
import json, sys
medians = json.load(open(sys.argv[1]))["medians"]
keys = [k for k in medians if "of_plain" in k or k.startswith("ratio")]
print(", ".join(f"{k} {medians[k]}" for k in keys))' "$out/$name.json")"
    else
        say "$name: FAILED (see $out/$name-stderr.txt)"
        status=1
    fi
}

if [ "$env_status" -eq 1 ]; then
    say "cuda tests: skipped: the environment check failed"
    say "device paths on the CPU stand-in: skipped: the environment check failed"
else
    if [ "$cuda" -eq 1 ]; then
        tests "cuda tests" 420 tests/test_cuda.py
    else
        say "cuda tests: skipped: no CUDA device"
    fi
    tests "device paths on the CPU stand-in" 420 tests/storage/test_device_order.py \
        tests/storage/test_cuda_edges.py tests/test_cuda_paths.py tests/storage/test_memory.py
fi
if [ "$cuda" -eq 1 ]; then
    bench bench_cuda benchmarks/bench_cuda.py --runs 3
    bench bench_adjust benchmarks/bench_adjust.py --runs 3
else
    say "bench_cuda: skipped: no CUDA device"
    say "bench_adjust: skipped: no CUDA device (its CPU figures: docs/benchmarks.md)"
fi
say "exit status $status"
exit "$status"
