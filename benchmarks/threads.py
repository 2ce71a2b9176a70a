"""Does `chunkmem finetune` oversubscribe the CPU? Training time by thread setting and competing load.

    python -m benchmarks.threads --json benchmarks/results/threads_cpu.json

Each cell runs `chunkmem finetune --steps N` (the bundled default) in a fresh process, with the
threads the settings give, while `--busy` other processes spin on the CPU (what two other users of a
shared 2-core machine look like), and reports the training time the command prints (start-up,
evaluation and saving excluded). "default" is what the command chooses by itself; the other
settings force a thread count through OMP_NUM_THREADS, as a user would.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.common import table, write_json

SETTINGS = {"default": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"},
            "OMP_NUM_THREADS=2": {"OMP_NUM_THREADS": "2"},
            "OMP_NUM_THREADS=2 OMP_WAIT_POLICY=passive": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "passive"}}


def train_seconds(steps: int, env: dict[str, str]) -> float:
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([sys.executable, "-m", "chunkmem.cli", "finetune", "--steps", str(steps),
                               "--eval-every", "0", "--output", out], env=env, capture_output=True, text=True,
                              timeout=3600)
    match = re.search(r"in ([\d.]+)s", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"finetune failed ({done.returncode}): {done.stderr[-2000:]}")
    return float(match.group(1))


def with_load(busy: int, fn: object) -> float:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)
        return fn()  # type: ignore[operator, no-any-return]
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="competing spinning processes")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = []
    for busy in args.busy:
        for name, extra in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
            env |= extra | {"TQDM_DISABLE": "1"}
            times = [with_load(busy, lambda: train_seconds(args.steps, env)) for _ in range(args.repeats)]
            rows.append({"busy": busy, "threads": name, "seconds": round(min(times), 2),
                         "all": " ".join(f"{t:.1f}" for t in times), "load_avg": round(os.getloadavg()[0], 2)})
            print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, ["busy", "threads", "seconds", "all", "load_avg"]))
    write_json(args.json, {"steps": args.steps, "cpus": os.cpu_count(), "rows": rows})


if __name__ == "__main__":
    main()
