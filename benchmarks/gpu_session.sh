#!/usr/bin/env bash
# One pass of everything the CUDA issues ask a lent GPU for, in one call of at most 8 minutes, on a machine whose
# python3 has a CUDA build of torch and transformers: the machine's facts, the native parts' build, the gpu-marked
# tests, the budgets table (benchmarks/gpu_budgets.py), the speed table (benchmarks/gpu_offload.py) and
# `chunkmem selftest`. Each part runs in processes of its
# own under its own time limit, so a crash or a hang ends that part only: a test that kills pytest is noted and the
# tests after it run in a fresh pytest. Logs, JSON and status.txt (each part's exit status) go to $OUT.
# Usage: bash benchmarks/gpu_session.sh. Limits (seconds): BUILD_S, TESTS_S, BUDGETS_S, OFFLOAD_S, SELFTEST_S.
# Don't carry a build cache (~/.cache/chunkmem) between machines: a fresh build takes about 75 s.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
mkdir -p "$out"
export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
start=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: its output to $OUT/NAME.log, its exit status to status.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name (at $(($(date +%s) - start)) s, at most ${limit} s)"
  timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
  local status=$?
  echo "$name $status" >>"$out/status.txt"
  tail -n 8 "$out/$name.log"
}

part machine 60 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import os, sys, torch, transformers; print(sys.version.split()[0], torch.__version__, \"cuda\",
  torch.version.cuda, \"transformers\", transformers.__version__, torch.cuda.get_device_name(), os.cpu_count(), \"cpus\")"'
part build "${BUILD_S:-120}" python3 -c 'from chunkmem.memory import native
print("cpu kernel:", native.load() is not None, "copy engine:", native.load_copy_engine() is not None,
      "missing:", native.missing())'

# The gpu tests, in as many pytest runs as crashes need: -v names each test before it runs, so the one a crash
# stopped is the last named without a result; it is deselected with those that ran, and the rest go on.
deadline=$(($(date +%s) + ${TESTS_S:-100}))
deselect=()
for round in 1 2 3 4; do
  left=$((deadline - $(date +%s)))
  [ "$left" -gt 10 ] || break
  part "gpu_tests_$round" "$left" python3 -m pytest -v -rfE -p no:cacheprovider -p no:randomly -m gpu \
    tests/memory/test_cuda.py "${deselect[@]}"
  tail -n 1 "$out/status.txt" | grep -qE " (0|1|5)$" && break  # finished: passed, failed or nothing left
  while read -r test; do deselect+=(--deselect "$test"); done < <(grep -oE "^tests/[^ ]+::[^ ]+" "$out/gpu_tests_$round.log")
  echo "crashed in: $(grep -oE "^tests/[^ ]+::[^ ]+" "$out/gpu_tests_$round.log" | tail -n 1)" | tee -a "$out/status.txt"
done

part budgets "${BUDGETS_S:-90}" python3 -m benchmarks.gpu_budgets --steps 4 --fractions 1.0,0.5,0.25 \
  --json "$out/gpu_budgets.json"
part offload "${OFFLOAD_S:-120}" python3 -m benchmarks.gpu_offload --steps 4 --shares none,0.5 \
  --json "$out/gpu_offload.json"
part selftest "${SELFTEST_S:-100}" python3 -m chunkmem.cli selftest --json "$out/selftest.json"
echo "done in $(($(date +%s) - start)) s" | tee -a "$out/status.txt"
