#!/usr/bin/env bash
# One pass of the CUDA checks on a GPU machine whose python3 already has a CUDA build of torch and
# transformers: the machine's facts, the native parts' build, the gpu-marked tests and `chunkmem selftest`.
# Logs and JSON go to $OUT (default gpu-out/). Usage: bash benchmarks/gpu_session.sh [pytest args...]
# Don't carry a build cache (~/.cache/chunkmem) between machines: a fresh build takes about a minute.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/machine.txt"
python3 - <<'EOF' | tee -a "$out/machine.txt"
import os, sys, torch, transformers
print(sys.version.split()[0], torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__,
      torch.cuda.get_device_name(), os.cpu_count(), "cpus")
from chunkmem.memory import native
print("cpu kernel:", native.load() is not None, "copy engine:", native.load_copy_engine() is not None,
      "missing:", native.missing())
EOF
# Verbose logs: a test that ends the process still leaves the names and results of those before it.
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -v -rfE -p no:cacheprovider -m gpu tests/memory/test_cuda.py "$@" \
  > "$out/gpu_tests.log" 2>&1
tail -n 40 "$out/gpu_tests.log"
timeout "${SELFTEST_S:-300}" python3 -m chunkmem.cli selftest --json "$out/selftest.json" 2>&1 | tee "$out/selftest.log"
# SUITE_S=N: then the rest of the suite for at most N seconds on SUITE_WORKERS processes (pytest-xdist and
# highspy needed), naming each failure as it comes.
if [ "${SUITE_S:-0}" -gt 0 ]; then
  timeout "$SUITE_S" python3 -m pytest -v -rfE -p no:cacheprovider -n "${SUITE_WORKERS:-12}" -m "not gpu" tests \
    > "$out/suite.log" 2>&1
  grep -E " (FAILED|ERROR) " "$out/suite.log" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -60
  grep -cE " PASSED " "$out/suite.log"
fi
