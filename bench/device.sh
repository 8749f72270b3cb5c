#!/usr/bin/env bash
# One device call: install, GPU tests, then the benchmark. Usage: bash bench/device.sh [bench args...]
set -o pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pytest -m gpu tests -q -x -s -p no:cacheprovider 2>&1 | tee ${OUT:-/tmp}/gpu_tests.log | grep -E "max \||passed|failed|Error|error" | head -60
fi
python3 bench/run.py "$@" --out ${OUT:-/tmp}/bench.json 2>&1 | tee ${OUT:-/tmp}/bench.log | tail -40
if [ -n "$SWEEP" ]; then python3 bench/sweep.py 2>&1 | tee ${OUT:-/tmp}/sweep.log; fi
