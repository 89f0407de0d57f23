#!/usr/bin/env bash
# A venv with SGLang 0.5.23's own storage code (cache controller, host pools, HiCacheStorage)
# beside this environment's torch and test tools, and this checkout's kvpool (editable), for
# tests/sglang_backend and benchmarks/bench_sglang.py: bash scripts/sglang_venv.sh [DIR]
# (default build/sglang-venv; then DIR/bin/python -m pytest tests/sglang_backend).
#
# SGLang itself goes in without its dependency list (CUDA kernels, torch 2.14.1: its server
# does not run on this CPU; docs/guides/sglang.md says why), then the pinned modules its
# storage code imports. Running it again does nothing once the venv imports everything.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-build/sglang-venv}"
check() {
  "$venv/bin/python" - <<'PY'
import warnings

warnings.filterwarnings("ignore")
import sglang.srt.managers.cache_controller  # noqa: F401
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
import torch

import kvpool
import kvpool.integrations.sglang
from importlib import metadata

print("sglang venv:", "SGLang", metadata.version("sglang"), "torch", torch.__version__,
      "kvpool from", kvpool.__file__)
PY
}
if [ -x "$venv/bin/python" ] && check 2>/dev/null; then
  exit 0
fi
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # (the venv's own old setuptools would shadow this environment's, which kvpool builds with)
  "$venv/bin/python" -m pip uninstall --quiet --yes setuptools
fi
# The venv sees this environment's packages (torch, numpy, valkey, pytest, ...) after its own,
# as the vLLM venv does (scripts/vllm_venv.sh).
outer=$(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])" | sort -u)
inner=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for dir in $outer; do
  echo "import site; site.addsitedir('$dir')"
done > "$inner/_kvpool_outer_env.pth"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps)
"${pip[@]}" sglang==0.5.23
"${pip[@]}" -r scripts/sglang_requirements.txt
cp scripts/sglang_no_torchvision.py "$inner/sglang_no_torchvision.py"
echo "import sglang_no_torchvision" > "$inner/sglang_no_torchvision.pth"
# kvpool from this checkout, ahead of any other on the path (no native build here: the
# checkout's compiled modules, if `pip install -e .` built them, are used as they are).
KVPOOL_BUILD_NATIVE=0 "${pip[@]}" --no-build-isolation -e .
check
