#!/usr/bin/env bash
# One device call: install, GPU tests, accuracy, then the benchmark (its table last).
#   bash bench/device.sh [bench/run.py args...]    env: SKIP_TESTS, GPU_TESTS, SWEEP, ACCURACY
# GPU_TESTS: the test files or node ids to run (default: all of tests/, which does not fit one 600 s call beside a
# benchmark: split it, e.g. GPU_TESTS="tests/test_gpu_engine.py tests/test_invariance.py")
set -o pipefail
export PYTHONUNBUFFERED=1
# The device image sets PYTHONDONTWRITEBYTECODE=1 over read-only site-packages without bytecode: every process
# compiled every module (import torch 5.3-7.4 s against 2.15 s). A pip install leaves bytecode; measure like one.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pyc}
O=${OUT:-/tmp}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v WARNING
python3 -c "import torch, triton, pandas, pyarrow, transformers, peft, tokenizers, safetensors, click
import policyscan.cli.main, policyscan.cli.score, policyscan.kernels.triton_ops, policyscan.engine.warmup.compile_procs"
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pytest -m gpu ${GPU_TESTS:-tests} -q -s -p no:cacheprovider --durations=12 > $O/gpu_tests.log 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed" $O/gpu_tests.log | tail -15
fi
if [ -n "$SWEEP" ]; then python3 bench/sweep.py > $O/sweep.log 2>&1; tail -12 $O/sweep.log; fi
if [ -n "$ACCURACY" ]; then python3 bench/accuracy.py 2>&1 | grep -v -i warn > $O/accuracy.log; tail -6 $O/accuracy.log; fi
python3 bench/run.py "$@" --out $O/bench.json > $O/bench.log 2>&1; tail -45 $O/bench.log
