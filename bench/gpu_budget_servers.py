#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Does the GPU budget hold? (issue 29, item 1.) On a machine with an NVIDIA GPU.

N unmodified llama-servers (a CUDA build, all layers on the GPU), each under the preload with
RESIDENCY_KEEP_ALIVE=10m and one RESIDENCY_GPU_BUDGET that holds fewer models than there are.
Greedy requests (n_predict 8, top-5 log-probs) go to them in three patterns:
  rr0    round-robin with no pause
  rr1.6  round-robin with 1.6 s pauses
  burst  bursts of N concurrent requests, one to each server, 1 s apart
From outside, `nvidia-smi --query-compute-apps` every 50 ms: the servers' summed GPU memory
against the budget (the largest excess and the time over). Each answer must equal that server's
first answer (tokens and top-5 log-probs). Writes one JSON with a list of {"check", "ok"}.

  bench/gpu_budget_servers.py --llama PREFIX --preload SO --tool RESIDENCY --out FILE.json [--models 3]
      [--size 12GiB] [--budget 28GiB|N%] [--hog-gib G] [--requests 30] [--dir DIR]
Uses only the Python standard library; shares gpu_bench.py (beside it) with gpu_router.py.
"""
import argparse, json, os, signal, subprocess, sys, threading, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import (GpuSampler, budget_mib as parse_budget_mib, complete, gpu_name, gpu_total_mib, host_cpu, log,  # noqa: E402
                       make_models, over_budget, quantile, request_body, same_answer, start_hog, sums)

p = argparse.ArgumentParser()
p.add_argument("--llama", required=True)
p.add_argument("--preload", required=True)
p.add_argument("--tool", required=True)
p.add_argument("--out", required=True)
p.add_argument("--models", type=int, default=3)
p.add_argument("--size", default="12GiB")
p.add_argument("--budget", default="28GiB", help="RESIDENCY_GPU_BUDGET's size: NGiB or N%%")
p.add_argument("--hog-gib", type=float, default=0,
               help="a PyTorch process outside the budget holds this much first: the GPU is full before the budget is")
p.add_argument("--requests", type=int, default=30)
p.add_argument("--dir", default="/tmp/gbs")
a = p.parse_args()
os.makedirs(a.dir, exist_ok=True)
total_mib = gpu_total_mib()
budget_mib = parse_budget_mib(a.budget, total_mib)
hog = start_hog(a.hog_gib)

models = make_models(a.tool, a.dir, a.models, a.size)

# Sampler: per-process GPU memory, every 50 ms.
sampler = GpuSampler(50).start()
samples = sampler.samples  # (t, {pid: MiB})

name = f"bench{os.getpid()}"
env = dict(os.environ, LD_PRELOAD=a.preload, RESIDENCY_KEEP_ALIVE="10m", RESIDENCY_LOG="info",
           RESIDENCY_GPU_BUDGET=f"{name}:{a.budget}")
servers = []
for i, m in enumerate(models):
    port = 18200 + i
    lf = open(f"{a.dir}/server-{i}.log", "w")
    pr = subprocess.Popen([f"{a.llama}/bin/llama-server", "-m", m, "-ngl", "999", "-c", "1024", "-np", "1", "--port",
                           str(port)], env=env, stdout=lf, stderr=subprocess.STDOUT)
    servers.append((pr, port))
    # One at a time: each load must find room (the others asked) rather than race.
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
            break
        except Exception:
            if pr.poll() is not None:
                break
            time.sleep(0.2)
    log("server", i, "up" if pr.poll() is None else f"exited {pr.returncode}")

pids = [s[0].pid for s in servers]


def ask(i):
    port = servers[i][1]
    return dict(server=i, **complete(f"http://127.0.0.1:{port}/completion", request_body(), f"server {i}", timeout=60))


first = {}
results = {}
ok_answers = True
for i in range(len(servers)):
    first[i] = ask(i)


def pattern(name, fn):
    global ok_answers
    t0 = time.time()
    out = fn()
    t1 = time.time()
    same = all(same_answer(r, first[r["server"]]) for r in out)
    ok_answers = ok_answers and same
    win = sums(samples, pids, t0, t1)
    max_excess, time_over = over_budget(win, budget_mib)
    dts = sorted(r["dt"] for r in out)
    q = lambda f: quantile(dts, f)
    results[name] = {"requests": len(out), "errors": sum(1 for r in out if "error" in r), "answers_equal": same, "request_s_p50": round(q(0.5), 4),
                     "request_s_p99": round(q(0.99), 4), "request_s_max": round(dts[-1], 4),
                     "samples": len(win), "max_sum_mib": max((x for _, x in win), default=None),
                     "max_excess_mib": round(max_excess, 1) if max_excess else 0, "time_over_s": round(time_over, 3),
                     "duration_s": round(t1 - t0, 2)}
    log(name, json.dumps(results[name]))


n = len(servers)
pattern("rr0", lambda: [ask(k % n) for k in range(a.requests)])


def rr16():
    out = []
    for k in range(a.requests // 2):
        out.append(ask(k % n))
        time.sleep(1.6)
    return out


pattern("rr1.6", rr16)


burst_ends = []


def bursts():
    out, lock = [], threading.Lock()
    for _ in range(max(3, a.requests // n // 2)):
        th = []
        for i in range(n):
            def go(i=i):
                r = ask(i)
                with lock:
                    out.append(r)
            th.append(threading.Thread(target=go))
        for t in th:
            t.start()
        for t in th:
            t.join()
        burst_ends.append(time.time())
        time.sleep(1.0)
    return out


pattern("burst", bursts)
time.sleep(0.5)
sampler.stop()
gpu = gpu_name()
for pr, _ in servers:
    pr.send_signal(signal.SIGTERM)
for pr, _ in servers:
    try:
        pr.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pr.kill()
if hog:
    hog.kill()
lines, all_lines = [], []
for i in range(n):
    with open(f"{a.dir}/server-{i}.log", errors="replace") as f:
        text = f.read().splitlines()
    all_lines += text
    lines += [f"server {i}: " + l.rstrip() for l in text if "residency[" in l]
with open(a.out.replace(".json", ".log"), "w") as f:
    f.write("\n".join(lines) + "\n")
t_first = samples[0][0] if samples else 0
series = [(round(t - t_first, 3), x) for t, x in sums(samples, pids)]
# A wake over the budget is allowed only while every other holder is inside a call (a burst), and
# must be repaid: 0.5-1.0 s after each burst's last answer the sum is back under the budget.
repaid = all(x <= budget_mib for e in burst_ends for t, x in ((t + t_first, x) for t, x in series) if e + 0.5 <= t <= e + 1.0)
rr_within = all(results[k]["max_excess_mib"] == 0 for k in ("rr0", "rr1.6"))
doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "host_cpu": host_cpu(),
       "models": n, "model_size": a.size, "budget": a.budget, "budget_mib": budget_mib, "hog_gib": a.hog_gib, "keep_alive": "10m", "patterns": results,
       "sum_mib_series": series,
       "checks": [{"check": "round-robin (no pause, 1.6 s pauses): the servers' summed GPU memory never exceeded the budget (50 ms samples)", "ok": rr_within},
                  {"check": "bursts: a wake over the budget is repaid, the sum back under it 0.5-1.0 s after each burst", "ok": repaid},
                  {"check": "every answer equals that server's first (tokens and top-5 log-probs)", "ok": ok_answers},
                  {"check": "every server loaded and answered", "ok": len(first) == n and all("error" not in f for f in first.values())},
                  {"check": "no out-of-memory error in any server's log",
                   "ok": not any("out of memory" in l and "out of device memory for" not in l for l in all_lines)}]}
with open(a.out, "w") as f:
    json.dump(doc, f, indent=1)
log("wrote", a.out)
