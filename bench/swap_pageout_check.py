#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What a pageout from outside, with swap on, takes from a llama.cpp program's model (issue 17's
item 4): decode_loop (tests/preload/decode_loop.c) serves a model, with and without the preload
(keep-alive forever), with llama.cpp's extra buffer types on and off. After its first token every
mapping of the process is paged out from here (process_madvise MADV_PAGEOUT, file and anonymous),
and the next token is timed; /proc/PID/status (VmRSS, RssAnon, RssFile, VmLck, VmSwap) is read
before and after. Needs root (a swap file is made under /var/tmp and removed), Linux >= 5.10.

  bench/swap_pageout_check.py DECODE_LOOP PRELOAD MODEL... > result.md
"""
import ctypes, os, re, subprocess, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procmem import page_out, status as status_mib  # noqa: E402


def status(pid):
    return {k: int(v) for k, v in status_mib(pid).items()}  # MiB

def run(loop, preload, model, no_repack):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESIDENCY_")}
    env.pop("LD_PRELOAD", None)
    if preload:
        env.update(LD_PRELOAD=preload, RESIDENCY_KEEP_ALIVE="forever", RESIDENCY_LOG="info")
    argv = [loop] + (["--no-repack"] if no_repack else []) + [model, "3", "stdin"]
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    def wait(prefix):
        while True:
            line = p.stdout.readline()
            if not line or line.startswith(prefix):
                return line
    wait("loaded")
    t0 = time.monotonic(); p.stdin.write("\n"); p.stdin.flush(); wait("token 0"); first = time.monotonic() - t0
    t0 = time.monotonic(); p.stdin.write("\n"); p.stdin.flush(); wait("token 1"); warm = time.monotonic() - t0
    before = status(p.pid)
    page_out(p.pid)
    time.sleep(0.5)
    after = status(p.pid)
    t0 = time.monotonic(); p.stdin.write("\n"); p.stdin.flush(); wait("token 2"); next_s = time.monotonic() - t0
    p.stdin.close()
    err = p.stderr.read()
    p.wait()
    lines = [l for l in err.splitlines() if re.match(r"residency(\[\d+\])?: info: preload:", l)]
    return first, warm, next_s, before, after, lines

def main():
    loop, preload, models = sys.argv[1], sys.argv[2], sys.argv[3:]
    swap = "/var/tmp/residency-swapfile"
    subprocess.run(["fallocate", "-l", "8G", swap], check=True)
    os.chmod(swap, 0o600)
    subprocess.run(["mkswap", swap], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["swapon", swap], check=True)
    try:
        print("| model | extra buffer types | preload | warm decode ms | after pageout ms | ratio | before: RSS anon/file, VmLck MiB | after: RSS anon/file, VmSwap MiB |")
        print("|---|---|---|---|---|---|---|---|")
        logs = []
        for model in models:
            for no_repack in (False, True):
                for pre in (None, preload):
                    first, warm, nxt, b, a, lines = run(loop, pre, model, no_repack)
                    print(f"| {os.path.basename(model)} | {'off' if no_repack else 'on'} | {'keep-alive forever' if pre else 'none (mmap)'} | "
                          f"{warm*1e3:.1f} | {nxt*1e3:.1f} | {nxt/warm:.2f} | {b['RssAnon']}/{b['RssFile']}, {b['VmLck']} | "
                          f"{a['RssAnon']}/{a['RssFile']}, {a['VmSwap']} |", flush=True)
                    if pre:
                        logs.append((os.path.basename(model), no_repack, lines))
        for m, nr, lines in logs:
            print(f"\n{m}, extra buffer types {'off' if nr else 'on'}:\n```")
            print("\n".join(lines))
            print("```")
    finally:
        subprocess.run(["swapoff", swap])
        os.unlink(swap)

if __name__ == "__main__":
    main()
