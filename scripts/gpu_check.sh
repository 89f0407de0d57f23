#!/usr/bin/env bash
# The checks that need a GPU (issue 34), in one run on a lent device: the CUDA tests (every move
# verified byte for byte, the race a missing wait would lose, the reference engine and the
# transformers cache on the device against transformers), then the figures: host <-> GPU
# bandwidth against a plain pinned copy (goal >= 80%) and adjust() against its copy (goal
# <= 1.5x). Prints everything; the figures also go to $OUT (or ./gpu-check) as JSON.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-check}"
mkdir -p "$out"
python3 -m pip install --quiet --disable-pip-version-check -e '.[dev,engine]' 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
status=0
KVPOOL_DEBUG=1 timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py \
    tests/storage/test_device_order.py tests/test_cuda_paths.py tests/storage/test_memory.py \
    2>&1 | tee "$out/tests.txt" | tail -25 || status=1
timeout 120 python3 benchmarks/bench_cuda.py --runs 3 | tee "$out/bench_cuda.json" || status=1
timeout 120 python3 benchmarks/bench_adjust.py --runs 3 | tee "$out/bench_adjust.json" || status=1
echo "gpu_check: exit status $status"
exit "$status"
