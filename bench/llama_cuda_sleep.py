#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Sleep and wake a real llama.cpp (CUDA build) through libresidency_preload.so, side by side with
staying resident and with what servers do today (unload the model when idle, load it again).

Each configuration runs tests/preload/serve_loop (a plain llama.cpp program) and the same
schedule: per cycle, forget the conversation, generate 4 tokens, stay idle PAUSE seconds, then
generate 4 more tokens continuing the same conversation (so the KV cache must survive the idle
time). GPU memory is read from outside the process (nvidia-smi) right after the first half and
near the end of the idle time. Greedy tokens of every cycle of every configuration must equal
the first cycle of the resident run.

  resident   no preload: the model stays on the GPU (the baseline)
  residency  LD_PRELOAD=libresidency_preload.so, RESIDENCY_KEEP_ALIVE shorter than PAUSE: the
             process sleeps (GPU memory given back, weights and KV cache in pinned host memory)
             and wakes at the same addresses at the next decode
  reload     no preload; the program frees model and context before the idle time and loads
             them again after it (Ollama's keep_alive, llama-server's --sleep-idle-seconds)

Exit status 0 when every check holds (tokens identical, asleep GPU memory <= 5 % of awake),
1 otherwise, 2 for bad arguments. Writes OUT/llama-cuda-sleep.{json,md}; `--report OUT` writes
them again from OUT's JSON and logs.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time


def gpu_used_mib():
    """(total used MiB on GPU 0, {pid: used MiB}) from nvidia-smi."""
    total = None
    per_pid = {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=20).stdout
        total = float(out.strip().splitlines()[0])
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        for line in out.strip().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit():
                try:
                    per_pid[int(parts[0])] = float(parts[1])
                except ValueError:
                    pass
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        pass
    return total, per_pid


class Loop:
    def __init__(self, args, env_extra, log_path):
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = args.llama_lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env.update(env_extra)
        self.log = open(log_path, "w")
        self.t_start = time.monotonic()
        self.p = subprocess.Popen([args.serve_loop, args.model], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=env, bufsize=1)
        line = self.p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"serve_loop did not start: {line!r} (log: {log_path})")
        self.load_us = int(line.split("load_us=")[1])

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"serve_loop exited on {cmd!r} (exit {self.p.wait()})")
        return line.strip()

    def gen(self, k):
        line = self.ask(f"gen {k}")
        fields = dict(f.split("=", 1) for f in line.split()[1:])
        return int(fields["first_us"]), [int(t) for t in fields["tokens"].split(",")]

    def close(self):
        try:
            self.ask("quit")
        except (RuntimeError, BrokenPipeError):
            pass
        rc = self.p.wait(timeout=120)
        self.log.close()
        return rc


def run_config(name, args, env_extra, out_dir, reload=False):
    before_total, _ = gpu_used_mib()
    loop = Loop(args, env_extra, os.path.join(out_dir, f"serve_loop-{name}.log"))
    pid = loop.p.pid
    cycles = []
    n = args.cycles if name.startswith("residency") else args.baseline_cycles
    for c in range(n):
        loop.ask("reset")
        first_a, tokens_a = loop.gen(4)
        total, per = gpu_used_mib()
        awake = per.get(pid, (total - before_total) if total is not None and before_total is not None else None)
        unload_us = None
        if reload:
            unload_us = int(loop.ask("unload").split("us=")[1])
        time.sleep(max(0.0, args.pause - args.sample_before_end))
        total, per = gpu_used_mib()
        idle = per.get(pid, (total - before_total) if total is not None and before_total is not None else None)
        time.sleep(args.sample_before_end)
        t_req = time.monotonic()
        load_us = None
        if reload:
            load_us = int(loop.ask("load").split("us=")[1])
        first_b, tokens_b = loop.gen(4)
        ttft_ms = (time.monotonic() - t_req) * 1e3 if reload else first_b / 1e3
        cycles.append({"cycle": c, "tokens": tokens_a + tokens_b, "first_token_ms_busy": first_a / 1e3,
                       "first_token_ms_after_idle": ttft_ms, "gpu_mib_awake": awake, "gpu_mib_idle": idle,
                       "unload_ms": unload_us / 1e3 if unload_us is not None else None,
                       "load_ms": load_us / 1e3 if load_us is not None else None})
        print(f"{name} cycle {c}: after idle {ttft_ms:.1f} ms, GPU MiB awake {awake} idle {idle}", flush=True)
    rc = loop.close()
    return {"name": name, "exit": rc, "initial_load_ms": loop.load_us / 1e3, "cycles": cycles}


def link_probe(gib):
    """Pinned host-to-device copy rate (GB/s) measured with PyTorch, or None."""
    try:
        import torch
        n = int(gib * (1 << 30))
        h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        d = torch.empty(n, dtype=torch.uint8, device="cuda")
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        best = None
        for _ in range(3):
            t = time.perf_counter()
            d.copy_(h, non_blocking=True)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            best = dt if best is None or dt < best else best
        del h, d
        torch.cuda.empty_cache()
        return n / best / 1e9
    except Exception as e:  # noqa: BLE001 - a probe, reported as missing
        print(f"link probe failed: {e}", file=sys.stderr)
        return None


def device_transitions(log_path, file_bytes):
    """The cuda manager's sleeps and wakes from the preloaded run's log: [(kind, MiB, ms)]. Its
    lines start "residency[PID]: info: cuda:N: " ("residency: info: cuda:N: " before the pid was in
    the prefix); a log written before the cuda:N prefix existed has only
    unprefixed lines, and there the host manager's (the GGUF mapping: the whole file, or its
    small CPU-side remainder) are told apart by size."""
    out, legacy = [], []
    pat = re.compile(r"residency(?:\[\d+\])?: info: (cuda:\d+: )?(released|re-wired) ([0-9.]+) MiB in \d+ set\(s\) in ([0-9.]+) ms")
    try:
        with open(log_path) as f:
            for line in f:
                m = pat.search(line)
                if not m:
                    continue
                kind = "sleep" if m.group(2) == "released" else "wake"
                mib, ms = float(m.group(3)), float(m.group(4))
                if m.group(1):
                    out.append((kind, mib, ms))
                elif mib >= 1024 and abs(mib * 2**20 - file_bytes) > 0.005 * file_bytes and ms > 0.01:
                    legacy.append((kind, mib, ms))
    except OSError:
        pass
    return out or legacy


def report(results, out_dir):
    runs = results["runs"]
    model_bytes = results["model_bytes"]
    ref = runs[0]["cycles"][0]["tokens"]
    checks = []
    for r in runs:
        same = all(c["tokens"] == ref for c in r["cycles"])
        checks.append((f"{r['name']}: tokens of every cycle equal the resident run's first cycle", same))
        checks.append((f"{r['name']}: exit status 0", r["exit"] == 0))
    gbps = lambda m, t: m * 2**20 / (t / 1e3) / 1e9  # noqa: E731
    link = results.get("link_h2d_gbps")
    notes = []
    for r in runs:
        if not r["name"].startswith("residency"):
            continue
        name, res = r["name"], r["cycles"]
        # The first cycle's idle sample may come while the first sleep (which pins the backup)
        # still runs; it is reported on its own, and the check is on the cycles after it.
        awake = [c["gpu_mib_awake"] for c in res if c["gpu_mib_awake"] is not None]
        idle = [c["gpu_mib_idle"] for c in res[1:] if c["gpu_mib_idle"] is not None]
        ratio = (max(idle) / statistics.median(awake)) if awake and idle else None
        r["asleep_over_awake"] = ratio
        checks.append((f"{name}: GPU memory while asleep <= 5 % of awake (nvidia-smi, cycles after the first)",
                       ratio is not None and ratio <= 0.05))
        tr = device_transitions(os.path.join(out_dir, f"serve_loop-{name}.log"), model_bytes)
        r["device_transitions"] = [{"kind": k, "mib": m, "ms": t} for k, m, t in tr]
        if ratio is not None:
            notes.append(f"- {name}: asleep / awake GPU memory (worst cycle after the first): {ratio * 100:.2f} %")
        c0 = res[0]
        notes.append(f"- {name}, first cycle: first token after idle {c0['first_token_ms_after_idle']:.1f} ms, "
                     f"GPU MiB at the idle sample {c0['gpu_mib_idle']}")
        sleeps = [(m, t) for k, m, t in tr if k == "sleep"]
        wakes = [(m, t) for k, m, t in tr if k == "wake"]
        if sleeps:
            notes.append(f"- {name}, first sleep: {sleeps[0][0]:.0f} MiB in {sleeps[0][1]:.1f} ms = "
                         f"{gbps(*sleeps[0]):.1f} GB/s (the manager's log line)")
        if len(sleeps) > 1:
            later = [gbps(m, t) for m, t in sleeps[1:]]
            notes.append(f"- {name}, later sleeps: median {statistics.median(later):.1f} GB/s "
                         f"({min(later):.1f}-{max(later):.1f}), {len(later)} of them")
        if wakes:
            w = [gbps(m, t) for m, t in wakes]
            notes.append(f"- {name}, wakes: median {statistics.median(w):.1f} GB/s ({min(w):.1f}-{max(w):.1f}), "
                         f"{len(w)} of them" + (f"; {statistics.median(w) / link:.3f} of the link" if link else ""))
    results["checks"] = [{"check": c, "ok": ok} for c, ok in checks]

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) if xs else float("nan")

    lines = [f"model {model_bytes / 2**30:.2f} GiB, idle {results['pause_s']} s per cycle, keep-alive {results['keep_alive']}",
             f"link (PyTorch pinned H2D, 4 GiB): {link:.1f} GB/s" if link else "link: not measured", "",
             "| configuration | cycles | first token after idle, median (min-max) ms | first token busy, median ms | "
             "GPU MiB awake | GPU MiB idle (median) | tokens identical |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in runs:
        cs = r["cycles"]
        after = [c["first_token_ms_after_idle"] for c in cs]
        same = all(c["tokens"] == ref for c in cs)
        lines.append(f"| {r['name']} | {len(cs)} | {med(after):.1f} ({min(after):.1f}-{max(after):.1f}) | "
                     f"{med([c['first_token_ms_busy'] for c in cs]):.1f} | {med([c['gpu_mib_awake'] for c in cs]):.0f} | "
                     f"{med([c['gpu_mib_idle'] for c in cs]):.0f} | {'yes' if same else 'NO'} |")
    lines.append("")
    if link:
        lines.append(f"- size / link bandwidth: {model_bytes / (link * 1e9) * 1e3:.1f} ms")
    lines.extend(notes)
    lines.append("")
    for c, ok in checks:
        lines.append(f"- {'PASS' if ok else 'FAIL'}: {c}")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "llama-cuda-sleep.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out_dir, "llama-cuda-sleep.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(ok for _, ok in checks) else 1


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--report":  # again, from a run's directory
        with open(os.path.join(sys.argv[2], "llama-cuda-sleep.json")) as f:
            return report(json.load(f), sys.argv[2])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve-loop", required=True)
    ap.add_argument("--preload", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--llama-lib", required=True, help="lib directory of the CUDA build of llama.cpp")
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--baseline-cycles", type=int, default=5)
    ap.add_argument("--pause", type=float, default=2.0, help="idle seconds per cycle")
    ap.add_argument("--keep-alive", default="500ms")
    ap.add_argument("--sample-before-end", type=float, default=0.3)
    ap.add_argument("--also-background-backup", action="store_true",
                    help="a fourth run: residency with RESIDENCY_CUDA_BACKUP=after-allocation")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    for p in (args.serve_loop, args.preload, args.model):
        if not os.path.exists(p):
            print(f"llama_cuda_sleep: no such file: {p}", file=sys.stderr)
            return 2
    if args.cycles < 1 or args.baseline_cycles < 1 or args.pause <= args.sample_before_end:
        print("llama_cuda_sleep: cycles must be >= 1 and --pause longer than --sample-before-end", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    model_bytes = os.path.getsize(args.model)

    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": args.model,
               "model_bytes": model_bytes, "pause_s": args.pause, "keep_alive": args.keep_alive}
    results["link_h2d_gbps"] = link_probe(4)
    runs = [run_config("resident", args, {}, args.out),
            run_config("residency", args, {"LD_PRELOAD": args.preload, "RESIDENCY_KEEP_ALIVE": args.keep_alive},
                       args.out),
            run_config("reload", args, {}, args.out, reload=True)]
    if args.also_background_backup:
        runs.append(run_config("residency-bg", args, {"LD_PRELOAD": args.preload, "RESIDENCY_KEEP_ALIVE": args.keep_alive,
                                                      "RESIDENCY_CUDA_BACKUP": "after-allocation"}, args.out))
    results["runs"] = runs
    return report(results, args.out)


if __name__ == "__main__":
    sys.exit(main())
