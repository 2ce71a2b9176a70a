#!/usr/bin/env bash
# One pass of everything the CUDA issues ask a lent GPU for, in one call of at most 8 minutes, on a machine whose
# python3 has a CUDA build of torch and transformers: the machine's facts, the native parts' build, the speed and
# budgets table of the 1.16B LLaMA (benchmarks/gpu_offload.py: plain, chunkmem at 100/50/25/10% of the model data
# and without a budget, at 50% with host updates made ahead, FSDP2's CPU offload and chunkmem in the memory FSDP2
# held, as far as the part's limit goes; each chunkmem row with its out-of-memory fallbacks and the bytes the device
# held against its budget), the gpu-marked tests, the self-test's checks the last run did not see pass, and the
# same table for a launch-bound LLaMA, the parts that matter most first (the host update's speed by thread count,
# benchmarks/host_threads.py, measured in run 5, is skipped unless THREADS_S is given). Each part runs in processes
# of its own under its own time limit, so a crash or a hang ends that part only: a test that kills pytest is noted
# and the tests after it run in a fresh pytest. status.txt (each part's exit status) and parts.tgz (each part's log
# and JSON, packed again after every part: a lent machine gives back 8 files at most, and a killed call keeps the
# parts done) go to $OUT.
# Usage: bash benchmarks/gpu_session.sh. Limits (seconds): BUILD_S, OFFLOAD_S, TESTS_S, THREADS_S, SELFTEST_S,
# TINY_S; at most 460 s in all with the machine's 30, so that a call of 8 minutes ends with every part's time limit
# and the packing between them; a limit of 0 skips the part. Rows and checks: SHARES
# (gpu_offload's --shares), SELFTEST_ONLY (check names, comma-separated; empty: every check).
# Don't carry a build cache (~/.cache/chunkmem) between machines: a fresh build takes about 75 s. The lent H200's
# image has pytest-timeout (2026-12); where a machine has none, unpack its wheel into build/gpu-pkgs here (pip
# download pytest-timeout --no-deps; python -m zipfile -e <wheel> build/gpu-pkgs), carry that folder and put it on
# PYTHONPATH. A machine kept warm between calls keeps the build: a second call can set BUILD_S=30.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}
logs=$(mktemp -d)
mkdir -p "$out"
export TQDM_DISABLE=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
start=$(date +%s)

part() {  # part NAME LIMIT_S COMMAND...: its output to NAME.log, its exit status to status.txt
  local name=$1 limit=$2
  shift 2
  [ "$limit" -gt 0 ] || return 0  # a limit of 0 skips the part
  echo "== $name (at $(($(date +%s) - start)) s, at most ${limit} s)"
  timeout -k 10 "$limit" "$@" >"$logs/$name.log" 2>&1
  local status=$?
  echo "$name $status" >>"$out/status.txt"
  tail -n 8 "$logs/$name.log"
  tar czf "$out/parts.tgz" -C "$logs" .
}

part machine 30 bash -c 'nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import os, sys, torch, transformers; print(sys.version.split()[0], torch.__version__, \"cuda\",
  torch.version.cuda, \"transformers\", transformers.__version__, torch.cuda.get_device_name(), os.cpu_count(),
  \"cpus\")"'
part build "${BUILD_S:-90}" python3 -c 'from chunkmem.memory import native
print("cpu kernel:", native.load() is not None, "copy engine:", native.load_copy_engine() is not None,
      "missing:", native.missing())'

part offload "${OFFLOAD_S:-160}" python3 -m benchmarks.gpu_offload --steps 4 \
  --shares "${SHARES:-1.0,0.5+ahead,0.5,0.25,0.1,none}" --json "$logs/gpu_offload.json"

# The gpu tests, in as many pytest runs as crashes need: -v names each test before it runs, so the one a crash
# stopped is the last named without a result; it is deselected with those that ran, and the rest go on. Those of the
# code no GPU has run yet first (the host update made ahead, the default setup, the sanitizer), then the others.
deadline=$(($(date +%s) + ${TESTS_S:-100}))
first="made_ahead or default_cuda_setup or sanitizer"
groups=("$first" "not ($first)")
group=0
deselect=()
# Each failure's reason printed as it happens (pytest prints them at the end, which a time limit cuts off), and no
# test longer than 100 s (the sanitizer's runs take longest) where pytest-timeout is installed.
per_test=(--tb=short)
python3 -c "import pytest_timeout" 2>/dev/null && per_test+=(--timeout 100)
for round in 1 2 3 4 5; do
  left=$((deadline - $(date +%s)))
  [ "$left" -gt 10 ] || break
  part "gpu_tests_$round" "$left" python3 -m pytest -v -rfE -p no:cacheprovider -p no:randomly -m gpu \
    "${per_test[@]}" -p tests.report_early -k "${groups[$group]}" tests/memory/test_cuda.py "${deselect[@]}"
  if tail -n 1 "$out/status.txt" | grep -qE " (0|1|5)$"; then  # the group finished: passed, failed or none left
    group=$((group + 1))
    [ "$group" -lt "${#groups[@]}" ] && continue || break
  fi
  named=$(grep -oE "^tests/[^ ]+::[^ []+(\[[^]]*\])?" "$logs/gpu_tests_$round.log")  # ids may hold spaces
  while read -r test; do deselect+=(--deselect "$test"); done <<<"$named"
  echo "crashed in: $(tail -n 1 <<<"$named")" | tee -a "$out/status.txt"
done
[ "$group" -lt "${#groups[@]}" ] &&
  echo "not finished (TESTS_S spent, or crashes): $(printf -- "-k '%s' " "${groups[@]:$group}")" | tee -a "$out/status.txt"

# Issue 36's host threads: the native update's speed by OpenMP team size, alone and beside a launching thread.
part host_threads "${THREADS_S:-0}" python3 -m benchmarks.host_threads --json "$logs/host_threads.json"

# Check names, comma-separated (empty: every check); by default those the last run did not see pass.
unseen="cuda vs plain and simulation,reserved memory vs budget,nccl,copy/compute overlap"
IFS=, read -ra only <<<"${SELFTEST_ONLY-$unseen}"
part selftest "${SELFTEST_S:-50}" python3 -m chunkmem.cli selftest --json "$logs/selftest.json" \
  ${only[@]:+--only "${only[@]}"}
part offload_tiny "${TINY_S:-30}" python3 -m benchmarks.gpu_offload --shape tiny --steps 8 --shares none,0.5 \
  --json "$logs/gpu_offload_tiny.json"
echo "done in $(($(date +%s) - start)) s" | tee -a "$out/status.txt"
