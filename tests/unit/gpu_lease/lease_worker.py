"""A separate process that takes GPU leases, for the lease tests (not a test module).

``hold``: lease N GPUs, print ``ACQUIRED <ids>``, keep them until a line (or EOF)
arrives on stdin, release, print ``RELEASED``.
``churn``: lease a random 1..N GPUs many times; while holding, claim each GPU id with
an O_EXCL marker file, so two holders of one id at the same time are caught
(``OVERLAP``, exit 3) however the scheduler interleaves them.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import random
import sys
import time

from harness.gpu_lease import GpuLeaser


def hold(leaser: GpuLeaser, n: int, timeout_s: float) -> int:
    with leaser.acquire(n, timeout_s=timeout_s) as lease:
        print("ACQUIRED", ",".join(map(str, lease.gpu_ids)), flush=True)
        sys.stdin.readline()
    print("RELEASED", flush=True)
    return 0


def churn(leaser: GpuLeaser, max_n: int, rounds: int, markers: pathlib.Path, seed: int) -> int:
    rng = random.Random(seed)
    for _ in range(rounds):
        n = rng.randint(1, max_n)
        with leaser.acquire(n, timeout_s=120) as lease:
            if len(lease.gpu_ids) != n or len(set(lease.gpu_ids)) != n:
                print("BAD LEASE", lease.gpu_ids, flush=True)
                return 4
            claimed = []
            try:
                for gpu_id in lease.gpu_ids:
                    fd = os.open(markers / f"gpu{gpu_id}", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                    os.close(fd)
                    claimed.append(gpu_id)
            except FileExistsError:
                print("OVERLAP", lease.gpu_ids, flush=True)
                return 3
            time.sleep(rng.uniform(0.001, 0.02))
            for gpu_id in claimed:
                os.unlink(markers / f"gpu{gpu_id}")
    print("DONE", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["hold", "churn"])
    parser.add_argument("--lock-dir", type=pathlib.Path, required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("-n", type=int, required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--markers", type=pathlib.Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    leaser = GpuLeaser(args.lock_dir, args.total)
    if args.mode == "hold":
        return hold(leaser, args.n, args.timeout)
    return churn(leaser, args.n, args.rounds, args.markers, args.seed)


if __name__ == "__main__":
    sys.exit(main())
