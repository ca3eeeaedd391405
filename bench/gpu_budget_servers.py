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
Uses only the Python standard library.
"""
import argparse, json, os, signal, statistics, subprocess, sys, threading, time, urllib.request

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
MiB = 1 << 20
total_mib = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split()[0])
budget_mib = total_mib * float(a.budget[:-1]) / 100 if a.budget.endswith("%") else float(a.budget[:-3]) * 1024
hog = None
if a.hog_gib > 0:
    hog = subprocess.Popen([sys.executable, "-c", "import sys,time,torch\n"
                            f"x=torch.empty({int(a.hog_gib * 2**30)},dtype=torch.uint8,device='cuda');print('ready',flush=True);time.sleep(3600)"],
                           stdout=subprocess.PIPE, text=True)
    hog.stdout.readline()


def log(*x):
    print(time.strftime("%T"), *x, flush=True)


models = []
for i in range(a.models):
    m = f"{a.dir}/model-{i}.gguf"
    if not os.path.exists(m):
        t = time.time()
        subprocess.run([a.tool, "make-model", "--size", a.size, "--type", "f16", "--seed", str(100 + i), m],
                       check=True, stdout=subprocess.DEVNULL)
        log("made", m, f"{time.time() - t:.1f} s")
    models.append(m)

# Sampler: per-process GPU memory, every 50 ms.
samples = []  # (t, {pid: MiB})
stop = threading.Event()


def sampler():
    q = subprocess.Popen(["nvidia-smi", "--query-compute-apps=timestamp,pid,used_memory", "--format=csv,noheader,nounits",
                          "-lms", "50"], stdout=subprocess.PIPE, text=True)
    cur_ts, cur = None, {}
    for line in q.stdout:
        if stop.is_set():
            break
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 3:
            continue
        ts, pid, mib = parts
        if ts != cur_ts and cur_ts is not None:
            samples.append((time.time(), cur))
            cur = {}
        cur_ts = ts
        try:
            cur[int(pid)] = int(mib)
        except ValueError:
            pass
    q.terminate()


threading.Thread(target=sampler, daemon=True).start()

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
    body = {"prompt": "Once upon a time", "n_predict": 8, "temperature": 0, "n_probs": 5, "cache_prompt": False,
            "seed": 1}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        r = json.loads(urllib.request.urlopen(req, timeout=60).read())
    except Exception as e:  # an error answer, a dead server: recorded, and the answers check fails
        log("request to server", i, "failed:", e)
        return {"server": i, "t": t, "dt": time.time() - t, "tokens": None, "probs": None, "error": str(e)}
    dt = time.time() - t
    probs = [[(c.get("id"), round(c.get("logprob", c.get("prob", 0)), 4)) for c in tok.get("top_logprobs", tok.get("probs", []))]
             for tok in r.get("completion_probabilities", [])]
    return {"server": i, "t": t, "dt": dt, "tokens": r.get("tokens") or r.get("content"), "probs": probs}


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
    same = all("error" not in r and r["tokens"] == first[r["server"]]["tokens"] and r["probs"] == first[r["server"]]["probs"]
               for r in out)
    ok_answers = ok_answers and same
    win = [(t, s) for t, s in samples if t0 <= t <= t1]
    sums = [(t, sum(v for p, v in s.items() if p in pids)) for t, s in win]
    over = [x - budget_mib for _, x in sums if x > budget_mib]
    time_over = 0.0
    for (ta, xa), (tb, _) in zip(sums, sums[1:]):
        if xa > budget_mib:
            time_over += tb - ta
    dts = sorted(r["dt"] for r in out)
    q = lambda f: dts[min(len(dts) - 1, int(f * len(dts)))]
    results[name] = {"requests": len(out), "errors": sum(1 for r in out if "error" in r), "answers_equal": same, "request_s_p50": round(q(0.5), 4),
                     "request_s_p99": round(q(0.99), 4), "request_s_max": round(dts[-1], 4),
                     "samples": len(sums), "max_sum_mib": max((x for _, x in sums), default=None),
                     "max_excess_mib": round(max(over), 1) if over else 0, "time_over_s": round(time_over, 3),
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
stop.set()
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                     text=True).stdout.strip()
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
series = [(round(t - t_first, 3), sum(v for p, v in s.items() if p in pids)) for t, s in samples]
# A wake over the budget is allowed only while every other holder is inside a call (a burst), and
# must be repaid: 0.5-1.0 s after each burst's last answer the sum is back under the budget.
repaid = all(x <= budget_mib for e in burst_ends for t, x in ((t + t_first, x) for t, x in series) if e + 0.5 <= t <= e + 1.0)
rr_within = all(results[k]["max_excess_mib"] == 0 for k in ("rr0", "rr1.6"))
doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "host_cpu": subprocess.run(
    "lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True, text=True).stdout.strip(),
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
