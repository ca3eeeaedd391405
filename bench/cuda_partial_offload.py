#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What a CUDA build of llama.cpp keeps in host memory, and what the preload wires of it (issue 17
item 5): tests/preload/serve_loop (a plain llama.cpp program) loads a model with some or all of
its layers on the GPU, with the file mapped or read into buffers, without and with
libresidency_preload.so (keep-alive KEEP_ALIVE). llama.cpp's own log gives its buffers per type;
/proc/PID/status and /proc/PID/smaps give what the kernel holds (VmLck, the model file's resident
and locked pages, anonymous memory, swap); nvidia-smi gives the GPU memory of the process.

Per run: gen 8 tokens; page out every mapping of the process from outside (process_madvise
MADV_PAGEOUT, file and anonymous; with swap on when the caller made some); gen 8 more, timed;
stay idle IDLE seconds (longer than the keep-alive); gen 8 more, timed. The tokens of the run
with the preload must equal those without.

  bench/cuda_partial_offload.py --serve-loop BIN --preload SO --llama-lib DIR --out DIR MODEL...

Writes OUT/cuda-partial-offload.{md,json} and the logs; exit 1 when tokens differ or a check fails.
"""
import argparse, json, os, re, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procmem import page_out, status  # noqa: E402

def gpu_mib(pid):
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            return float(parts[1])
    return 0.0


def snapshot(pid, model):
    """MiB: VmRSS, RssAnon, RssFile, VmLck, VmSwap; the model file's Rss and Locked; GPU."""
    s = status(pid)
    file_rss = file_lck = 0
    real = os.path.realpath(model)
    cur = None
    for line in open(f"/proc/{pid}/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            cur = line.split(None, 5)[5].strip() if len(line.split(None, 5)) == 6 else ""
        elif cur == real and line.startswith("Rss:"):
            file_rss += int(line.split()[1])
        elif cur == real and line.startswith("Locked:"):
            file_lck += int(line.split()[1])
    s["model_file_rss"] = file_rss / 1024
    s["model_file_locked"] = file_lck / 1024
    s["gpu"] = gpu_mib(pid)
    return s


class Loop:
    def __init__(self, args, argv, env_extra, log_path):
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = args.llama_lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env.update(env_extra)
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.p = subprocess.Popen([args.serve_loop, "--llama-log"] + argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.log, text=True, env=env)
        line = self.p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"serve_loop did not start: {line!r} (log: {log_path})")

    def gen(self, k):
        self.p.stdin.write(f"gen {k}\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        m = re.match(r"gen first_us=(\d+) total_us=(\d+) tokens=(\S+)", line)
        if not m:
            raise RuntimeError(f"serve_loop: {line!r} (log: {self.log_path})")
        return int(m.group(1)) / 1000, m.group(3)

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
            self.p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.p.kill()
            self.p.wait()
        self.log.close()


def buffers_from_log(path):
    """llama.cpp's buffer lines and the preload's registration lines, as logged."""
    llama, ours = [], []
    for line in open(path, errors="replace"):
        line = line.rstrip()
        if re.search(r"(model|KV|compute|output) buffer size", line):
            llama.append(re.sub(r"\s+", " ", line))
        if "preload:" in line and ("registered" in line or "not managed" in line or "gave back" in line):
            ours.append(line[line.index("preload:"):])
    return llama, ours


def run(args, name, model, argv, preload):
    env = {}
    if preload:
        env = {"LD_PRELOAD": args.preload, "RESIDENCY_KEEP_ALIVE": args.keep_alive, "RESIDENCY_LOG_LEVEL": "info"}
    log = os.path.join(args.out, f"{name}-{'preload' if preload else 'plain'}.log")
    loop = Loop(args, argv, env, log)
    r = {"config": name, "preload": preload}
    try:
        _, r["tokens1"] = loop.gen(8)
        r["loaded"] = snapshot(loop.p.pid, model)
        r["paged_out_bytes"] = page_out(loop.p.pid)
        time.sleep(0.5)
        r["after_pageout"] = snapshot(loop.p.pid, model)
        r["first_ms_after_pageout"], r["tokens2"] = loop.gen(8)
        r["first_ms_warm"], _ = loop.gen(1)
        time.sleep(args.idle)
        r["idle"] = snapshot(loop.p.pid, model)
        r["first_ms_after_idle"], r["tokens3"] = loop.gen(8)
        r["awake_again"] = snapshot(loop.p.pid, model)
    finally:
        loop.close()
    r["llama_buffers"], r["registered"] = buffers_from_log(log)
    return r


def fmt(s, k):
    v = s.get(k)
    return "-" if v is None else f"{v:.0f}"


def serve_loop_parser(doc):
    """The arguments every serve_loop harness takes: the program, the preload, llama.cpp's lib/, OUT."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--serve-loop", required=True, help="tests/preload/serve_loop, built")
    ap.add_argument("--preload", required=True, help="libresidency_preload.so")
    ap.add_argument("--llama-lib", required=True, help="the lib/ directory of the llama.cpp build")
    ap.add_argument("--out", required=True, help="directory for the results and logs")
    return ap


def main():
    ap = serve_loop_parser(__doc__)
    ap.add_argument("--keep-alive", default="3s")
    ap.add_argument("--idle", type=float, default=5.0)
    ap.add_argument("--layers", type=int, required=True, help="the models' layer count (half go to the GPU)")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    half = str(args.layers // 2)
    results, ok = [], True
    for model in args.models:
        base = os.path.basename(model).removesuffix(".gguf")
        configs = [(f"{base}-mmap-ngl{half}", [model, half]),
                   (f"{base}-nommap-ngl{half}", ["--no-mmap", model, half]),
                   (f"{base}-mmap-ngl999", [model, "999"])]
        for name, argv in configs:
            plain = run(args, name, model, argv, False)
            pre = run(args, name, model, argv, True)
            same = all(plain[t] == pre[t] for t in ("tokens1", "tokens2", "tokens3"))
            pre["tokens_equal_plain"] = same
            ok &= same
            results += [plain, pre]
            print(f"{name}: tokens equal: {same}", flush=True)
    with open(os.path.join(args.out, "cuda-partial-offload.json"), "w") as f:
        json.dump(results, f, indent=1)
    cols = ["VmRSS", "RssAnon", "RssFile", "VmLck", "VmSwap", "model_file_rss", "model_file_locked", "gpu"]
    lines = ["# CUDA llama.cpp: host memory with partial and full offload, without and with the preload", "",
             f"keep-alive {args.keep_alive}, idle {args.idle} s; MiB; 'model file' = the GGUF mapping's pages "
             "(smaps Rss / Locked); gpu = nvidia-smi used_memory of the process", ""]
    for r in results:
        lines.append(f"## {r['config']} {'with the preload' if r['preload'] else 'plain'}")
        lines.append("")
        lines += ["llama.cpp: " + b for b in r["llama_buffers"]] + ["residency: " + b for b in r["registered"]]
        lines += ["", "| when | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for when in ("loaded", "after_pageout", "idle", "awake_again"):
            lines.append(f"| {when} | " + " | ".join(fmt(r[when], c) for c in cols) + " |")
        lines.append("")
        lines.append(f"first token ms: warm {r['first_ms_warm']:.1f}, after the pageout {r['first_ms_after_pageout']:.1f}, "
                     f"after the idle {r['first_ms_after_idle']:.1f}" +
                     (f"; tokens equal to the plain run: {r['tokens_equal_plain']}" if r["preload"] else ""))
        lines.append("")
    with open(os.path.join(args.out, "cuda-partial-offload.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
