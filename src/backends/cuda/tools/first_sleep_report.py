#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Tables of residency's cuda sleep/wake rates against PyTorch's in the same run, from the JSON
that residency_cuda_bench (--json) and torch_sleep_wake_baseline.py (--json) wrote. Markdown on
stdout.

usage: first_sleep_report.py CUDA_BENCH_JSON TORCH_BASELINE_JSON
"""
import json
import sys


def median(v):
    v = sorted(v)
    if not v:
        return 0.0
    m = len(v) // 2
    return v[m] if len(v) % 2 else (v[m - 1] + v[m]) / 2


def rate(b, s):
    return b / s / 1e9 if s else 0.0


def ratio(a, b):
    return f"{a / b:.2f}" if b else "-"


def main():
    bench = json.load(open(sys.argv[1]))
    torch = json.load(open(sys.argv[2])) if len(sys.argv) > 2 else {"results": []}
    by = {(r["mode"], r["bytes"]): r for r in torch["results"] if "error" not in r}
    gib = lambda b: f"{b / (1 << 30):g}"

    print("### residency (cuda backend), GB/s")
    print()
    print("| size | first sleep | target 25 | later sleep | plain D2H | ratio | wake | plain H2D | ratio | "
          "backup − size (B) | cuMemHostAlloc alone | prepare_backup | first sleep after it |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in bench["sizes"]:
        b = r["bytes"]
        fs = rate(b, r["first_sleep_s"])
        print(f"| {gib(b)} GiB | {fs:.2f} | {'met' if fs >= 25 else 'missed'} | {r['sleep_GBps']:.2f} | "
              f"{r['plain_d2h_GBps']:.2f} | {r['sleep_ratio']:.3f} | {r['wake_GBps']:.2f} | "
              f"{r['plain_h2d_GBps']:.2f} | {r['wake_ratio']:.3f} | {r['backup_bytes'] - b} | "
              f"{rate(b, r['plain_pin_s']):.2f} | {rate(b, r['prepare_backup_s']):.2f} | "
              f"{rate(b, r['prepared_first_sleep_s']):.2f} |")
    print()
    print(f"Pinning pipeline of the rows above: {bench['sizes'][0].get('pin_pipeline', '?')}, "
          f"{bench['sizes'][0]['pin_threads']} faulting threads.")
    if bench.get("pin_sweep"):
        print()
        print("First sleep by pinning pipeline and faulting threads: " + ", ".join(
            f"{r.get('pin_pipeline', '?')} {r['pin_threads']} threads {rate(r['bytes'], r['first_sleep_s']):.1f} GB/s"
            for r in bench["pin_sweep"]) + f" ({gib(bench['pin_sweep'][0]['bytes'])} GiB)")
    print()
    print("Diagnostics, GB/s (medians): plain H2D into device memory allocated just before it (cuMemAlloc + "
          "cuMemcpyHtoD), and the wake's chunked copies from the backup into device memory that exists already:")
    print()
    print("| size | plain H2D, reused memory | plain H2D, fresh memory | wake copies, reused memory | wake |")
    print("|---|---:|---:|---:|---:|")
    for r in bench["sizes"]:
        b = r["bytes"]
        print(f"| {gib(b)} GiB | {r['plain_h2d_GBps']:.2f} | {rate(b, median(r.get('fresh_h2d_s', []))):.2f} | "
              f"{rate(b, median(r.get('backup_h2d_reused_s', []))):.2f} | {r['wake_GBps']:.2f} |")

    print()
    print("### PyTorch in the same run, GB/s (sleep includes freeing the device tensor, wake allocating it)")
    print()
    print("| size | mode | first sleep | later sleep | sleep copy_ only | wake | wake copy_ only | pin_memory alloc |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (mode, b), r in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {gib(b)} GiB | {mode} | {rate(b, r['first_sleep_s']):.2f} | {rate(b, median(r['sleep_s'])):.2f} | "
              f"{rate(b, median(r['sleep_copy_s'])) if r['sleep_copy_s'] else 0:.2f} | "
              f"{rate(b, median(r['wake_s'])):.2f} | "
              f"{rate(b, median(r['wake_copy_s'])) if r['wake_copy_s'] else 0:.2f} | "
              f"{rate(b, r.get('pin_alloc_s', 0)):.2f} |")
    for r in by.values():
        if "odd_pinned_request_bytes" in r:
            print()
            print(f"A pinned PyTorch tensor of {r['odd_pinned_request_bytes']} B took "
                  f"{r['odd_pinned_host_bytes_taken'] / (1 << 30):.3f} GiB of host memory (MemAvailable).")

    print()
    print("### residency as a ratio to PyTorch (rate / rate; > 1: residency is faster)")
    print()
    print("| size | first sleep / pinned first sleep | first sleep / naive .cpu() | later sleep / pinned sleep "
          "| later sleep / pinned copy_ | later sleep / naive | wake / pinned wake | wake / pinned copy_ | wake / naive .cuda() |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in bench["sizes"]:
        b = r["bytes"]
        p = by.get(("pinned", b))
        n = by.get(("naive", b))
        fs = rate(b, r["first_sleep_s"])
        sl = r["sleep_GBps"]
        wk = r["wake_GBps"]
        cells = [
            ratio(fs, rate(b, p["first_sleep_s"])) if p else "-",
            ratio(fs, rate(b, n["first_sleep_s"])) if n else "-",
            ratio(sl, rate(b, median(p["sleep_s"]))) if p else "-",
            ratio(sl, rate(b, median(p["sleep_copy_s"]))) if p else "-",
            ratio(sl, rate(b, median(n["sleep_s"]))) if n else "-",
            ratio(wk, rate(b, median(p["wake_s"]))) if p else "-",
            ratio(wk, rate(b, median(p["wake_copy_s"]))) if p else "-",
            ratio(wk, rate(b, median(n["wake_s"]))) if n else "-",
        ]
        print(f"| {gib(b)} GiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
