#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""PyTorch's own ways to put a GPU tensor to sleep in host memory and wake it, timed the way
residency_cuda_bench times the cuda backend, so that one run can report residency's rates as ratios
to them.

Per size, each mode in a process of its own (so that one mode's pinned or cached memory does
not stay around for the next):

  pinned  sleep = h.copy_(x) into a pinned host tensor, then free the device tensor
          (del x; torch.cuda.empty_cache()); wake = torch.empty(device="cuda") + x.copy_(h).
          The first sleep also allocates h with torch.empty(pin_memory=True) (PyTorch's
          caching host allocator: cudaHostAlloc, rounded up to a power of two). The copy_
          part of each is reported apart as well.
  naive   sleep = h = x.cpu(); del x; torch.cuda.empty_cache(); wake = x = h.cuda(); del h
          (pageable host memory, allocated anew by every sleep).

Every wake is checked against the contents before the first sleep on a strided sample of
2^20 words. The host memory a
pinned tensor of 1 GiB + 4099 bytes takes (MemAvailable before and after) shows the rounding.

usage: torch_sleep_wake_baseline.py [--sizes 1,16,64] [--iterations 3] [--modes pinned,naive]
                                    [--json FILE]
"""
import argparse
import json
import os
import subprocess
import sys
import time

GIB = 1 << 30


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def child(mode, gib, iterations):
    import torch

    n = int(gib * GIB)
    words = n // 8
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    step = max(1, words // (1 << 20))

    def make():
        x = torch.arange(words, dtype=torch.int64, device=dev)
        sync()
        return x

    ref = None

    def check(x, what):
        if not torch.equal(x[::step], ref):
            raise SystemExit(f"{what}: contents differ")

    res = {"mode": mode, "bytes": n, "iterations": iterations, "torch": torch.__version__,
           "sleep_s": [], "wake_s": [], "sleep_copy_s": [], "wake_copy_s": []}
    x = make()
    ref = x[::step].clone()  # what every wake must give back (a sample of 2^20 words)
    if mode == "pinned":
        avail0 = meminfo()["MemAvailable"]
        t0 = time.perf_counter()
        h = torch.empty(words, dtype=torch.int64, pin_memory=True)
        res["pin_alloc_s"] = time.perf_counter() - t0
        h.copy_(x)
        sync()
        res["first_sleep_copy_s"] = time.perf_counter() - t0
        del x
        torch.cuda.empty_cache()
        sync()
        res["first_sleep_s"] = time.perf_counter() - t0
        res["pinned_host_bytes_taken"] = avail0 - meminfo()["MemAvailable"]
        for it in range(iterations + 1):
            t0 = time.perf_counter()
            x = torch.empty(words, dtype=torch.int64, device=dev)
            t1 = time.perf_counter()
            x.copy_(h)
            sync()
            t2 = time.perf_counter()
            check(x, "pinned wake")
            t3 = time.perf_counter()
            h.copy_(x)
            sync()
            t4 = time.perf_counter()
            del x
            torch.cuda.empty_cache()
            sync()
            t5 = time.perf_counter()
            res["wake_s"].append(t2 - t0)
            res["wake_copy_s"].append(t2 - t1)
            res["sleep_s"].append(t5 - t3)
            res["sleep_copy_s"].append(t4 - t3)
        # the first cycle after the first sleep is a warm-up (allocator, first touch)
        for k in ("wake_s", "wake_copy_s", "sleep_s", "sleep_copy_s"):
            res[k] = res[k][1:]
        del h
        if gib <= 1:
            # PyTorch's caching host allocator rounds a pinned block up to a power of two.
            odd = n + 4099
            avail0 = meminfo()["MemAvailable"]
            h2 = torch.empty(odd, dtype=torch.uint8, pin_memory=True)
            res["odd_pinned_request_bytes"] = odd
            res["odd_pinned_host_bytes_taken"] = avail0 - meminfo()["MemAvailable"]
            del h2
    else:
        for it in range(iterations):
            t0 = time.perf_counter()
            h = x.cpu()
            del x
            torch.cuda.empty_cache()
            sync()
            t1 = time.perf_counter()
            x = h.cuda()
            sync()
            t2 = time.perf_counter()
            del h
            check(x, "naive wake")
            res["sleep_s"].append(t1 - t0)
            res["wake_s"].append(t2 - t1)
        res["first_sleep_s"] = res["sleep_s"][0]
    print("RESULT " + json.dumps(res), flush=True)


def median(v):
    v = sorted(v)
    if not v:
        return 0.0
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--modes", default="pinned,naive")
    ap.add_argument("--json")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "GIB", "ITERATIONS"))
    a = ap.parse_args()
    if a.child:
        child(a.child[0], float(a.child[1]), int(a.child[2]))
        return
    import torch  # only for the header

    results = []
    header = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "python": sys.executable, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    print(f"torch {header['torch']} (CUDA {header['cuda']}) on {header['gpu']}, {sys.executable}", flush=True)
    print(f"{'mode':>7} {'GiB':>6} | {'1st sleep':>10} {'sleep':>8} {'sleep cp':>8} | {'wake':>8} {'wake cp':>8} | "
          f"{'pin alloc':>9}   (GB/s; medians)", flush=True)
    for gib in [float(s) for s in a.sizes.split(",")]:
        for mode in a.modes.split(","):
            # naive .cpu() runs at ~1.4 GB/s: fewer rounds for the large sizes
            iters = a.iterations if mode == "pinned" else max(1, min(a.iterations, int(32 // gib)))
            cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, str(gib), str(iters)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                print(f"{mode} {gib} GiB failed (exit {p.returncode}):\n{p.stdout}\n{p.stderr}", flush=True)
                results.append({"mode": mode, "bytes": int(gib * GIB), "error": p.stderr[-2000:]})
                continue
            r = json.loads(line[0][len("RESULT "):])
            results.append(r)
            b = r["bytes"]
            rate = lambda s: b / s / 1e9 if s else 0.0
            print(f"{mode:>7} {gib:6.1f} | {rate(r['first_sleep_s']):10.2f} {rate(median(r['sleep_s'])):8.2f} "
                  f"{rate(median(r['sleep_copy_s'])):8.2f} | {rate(median(r['wake_s'])):8.2f} "
                  f"{rate(median(r['wake_copy_s'])):8.2f} | {rate(r.get('pin_alloc_s', 0)):9.2f}", flush=True)
            if "odd_pinned_request_bytes" in r:
                print(f"        pinned tensor of {r['odd_pinned_request_bytes']} B took "
                      f"{r['odd_pinned_host_bytes_taken'] / GIB:.3f} GiB of host memory", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": header, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
