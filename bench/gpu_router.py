#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""llama.cpp's own router under a GPU budget (issue item 5). On a machine with an NVIDIA GPU.

`llama-server --models-dir DIR` (router mode) with N make-model models of SIZE, all layers on the
GPU, in up to three configurations, run in the order given:
  resident   --models-max 0, no preload: every model loaded once and kept; its answers are the
             reference and its request times the warm times
  plain      --models-max 2 (--plain-models-max), no preload: the router unloads the least recently
             used model and loads the next (about 3 s a switch): runs rr0 and random only
  residency  --models-max 0 under the preload, RESIDENCY_KEEP_ALIVE=10m and
             RESIDENCY_GPU_BUDGET=NAME:BUDGET (two models' worth): idle models sleep; a wake that
             finds every holder inside a call goes over the budget (RESIDENCY_BUDGET_WAIT=over)
  strict     the same with RESIDENCY_BUDGET_WAIT=WAIT (--budget-wait, 30s): such a wake waits its
             turn for room, and the budget holds
Each configuration first loads every model once (one request each, not counted), then runs the
request patterns (greedy, n_predict 8, top-5 log-probs, POST /completion with "model"):
  rr0     round-robin with no pause
  rr1.6   round-robin, 1.6 s between an answer and the next request
  random  random.Random(SEED) over the models, never the same twice in a row
  burst   bursts of one concurrent request to each model, 1 s apart (REQUESTS / N bursts)
  burst0  the same bursts back to back (the next starts when the last answer came)
A switch is a request to another model than the previous request's (in a burst: every request);
its time is the request's wall time. From outside, `nvidia-smi --query-compute-apps` every 50 ms:
the router's and its children's summed GPU memory against the budget. After the patterns, each
child's host memory: pinned host bytes (`residency stat --json [--pid]`), RSS, and each GGUF's
page-cache bytes (mincore). Writes OUT (JSON, with a list of {"check", "ok"}), OUT's .csv
(config,pattern,t_s,gpu_mib,budget_mib, for gnuplot) and .log (the residency lines).

A configuration's results are also kept as DIR/config-NAME.json: a later call that leaves it out
of --configs reports it from there (same models), so the configurations can run in separate calls:
  gpu_router.py ... --configs resident;  gpu_router.py ... --configs plain;  gpu_router.py ... --configs residency

  bench/gpu_router.py --llama PREFIX --preload SO --tool RESIDENCY --out FILE.json [--models 4] [--size 12GiB]
      [--budget 28GiB|N%] [--hog-gib G] [--configs resident,plain,residency] [--patterns rr0,rr1.6,random,burst]
      [--requests 32] [--plain-requests 32] [--seed 7] [--dir /tmp/gr] [--port 8090] [--no-gpu]
Uses only the Python standard library; shares gpu_bench.py (beside it) with gpu_budget_servers.py.
"""
import argparse, ctypes, json, os, random, signal, subprocess, sys, threading, time, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import (MiB, GpuSampler, answer_from_json, budget_mib as parse_budget_mib, complete, gpu_name,  # noqa: E402
                       gpu_total_mib, host_cpu, log, make_model, over_budget, quantile, request_body, same_answer,
                       start_hog, sums)

CONFIGS = ("resident", "plain", "residency", "strict")
PRELOADED = ("residency", "strict")
PATTERNS = ("rr0", "rr1.6", "random", "burst", "burst0")
BURSTS = ("burst", "burst0")
PLAIN_PATTERNS = ("rr0", "random")  # the plain router pays seconds per switch
SEQUENTIAL = ("rr0", "rr1.6", "random")
SERIES_POINTS = 4000


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="llama.cpp's router (llama-server --models-dir) under a GPU budget: "
                                "switch times, the GPU sum against the budget, host bytes, answers")
    p.add_argument("--llama", required=True, help="llama.cpp prefix: PREFIX/bin/llama-server")
    p.add_argument("--preload", required=True, help="libresidency_preload.so")
    p.add_argument("--tool", required=True, help="the residency CLI (make-model, stat --json)")
    p.add_argument("--out", required=True, help="the JSON to write; .csv and .log beside it")
    p.add_argument("--models", type=int, default=4)
    p.add_argument("--size", default="12GiB", help="each model's size, for make-model (12GiB, 64MiB)")
    p.add_argument("--mix", default="", help="models of mixed size and type instead of --models x --size F16: "
                   "SIZE:TYPE[:SEED],... (12GiB:f16,12GiB:q8_0,12GiB:f16:100,8GiB:q8_0; the same seed, type and size: "
                   "the same bytes in another file)")
    p.add_argument("--budget", default="28GiB", help="RESIDENCY_GPU_BUDGET's size: NGiB or N%% (of the GPU)")
    p.add_argument("--hog-gib", type=float, default=0,
                   help="a PyTorch process outside the budget holds this much first (plain and residency; the "
                        "resident router, which needs every model at once, runs without it)")
    p.add_argument("--configs", default="resident,plain,residency", help="comma list of " + ",".join(CONFIGS))
    p.add_argument("--budget-wait", default="30s", help="the strict configuration's RESIDENCY_BUDGET_WAIT")
    p.add_argument("--log-level", default="info", help="RESIDENCY_LOG under the preload (debug: each switch's timeline)")
    p.add_argument("--patterns", default="rr0,rr1.6,random,burst", help="comma list of " + ",".join(PATTERNS))
    p.add_argument("--requests", type=int, default=32, help="requests per pattern")
    p.add_argument("--plain-requests", type=int, default=32, help="requests per pattern of the plain router (rr0, random)")
    p.add_argument("--plain-models-max", type=int, default=2, help="the plain router's --models-max")
    p.add_argument("--seed", type=int, default=7, help="the random pattern's seed")
    p.add_argument("--link-gbs", type=float, default=55.2, help="host-to-device GB/s (1e9 B/s), for the switch-time check")
    p.add_argument("--kv-compute-mib", type=float, default=1024,
                   help="a server's KV cache and compute buffers, for the pinned-host-bytes check")
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--dir", default="/tmp/gr")
    p.add_argument("--port", type=int, default=8090)
    p.add_argument("--keep-models", action="store_true", help="keep the GGUFs (the default too: they are never deleted)")
    p.add_argument("--no-reuse", action="store_true", help="report only the configurations run in this call")
    p.add_argument("--no-gpu", action="store_true", help="a CPU trial: -ngl 0, no nvidia-smi, no hog")
    a = p.parse_args(argv)
    a.configs = [c for c in a.configs.split(",") if c]
    a.patterns = [x for x in a.patterns.split(",") if x]
    for c in a.configs:
        if c not in CONFIGS:
            p.error(f"--configs: unknown {c!r} (one of {', '.join(CONFIGS)})")
    for x in a.patterns:
        if x not in PATTERNS:
            p.error(f"--patterns: unknown {x!r} (one of {', '.join(PATTERNS)})")
    return a


# ---- processes and host memory ------------------------------------------------------------------

def descendants(root):
    """Every live descendant of `root` (from /proc/*/stat)."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        kids.setdefault(int(st[st.rfind(")") + 2:].split()[1]), []).append(int(d))
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            st = f.read()
        return st[st.rfind(")") + 2] != "Z"
    except OSError:
        return False


def proc_status(pid):
    """/proc/PID/status's memory lines, in bytes."""
    keys = {"VmRSS": "vm_rss", "RssAnon": "rss_anon", "RssFile": "rss_file", "RssShmem": "rss_shmem", "VmLck": "vm_lck",
            "VmSwap": "vm_swap"}
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in keys:
                    out[keys[k]] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("MemTotal", "MemAvailable", "Cached", "Mlocked", "Shmem", "Unevictable"):
                out[k] = int(v.split()[0]) * 1024
    return out


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_ODD = bytes(i & 1 for i in range(256))


def page_cache_bytes(path):
    """How much of `path` is in the page cache: mincore over a read-only mapping (which reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr is None or addr == ctypes.c_void_p(-1).value:
            return None
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                return None
            return min(bytes(vec).translate(_ODD).count(1) * page, size)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def run_json(cmd):
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        return json.loads(r.stdout) if r.returncode == 0 else {"error": (r.stderr or r.stdout).strip()[-400:]}
    except Exception as e:
        return {"error": str(e)}


# ---- pure helpers (no process, no GPU) ----------------------------------------------------------

def random_order(seed, n, count):
    """`count` model indices from random.Random(seed), never the same twice in a row."""
    rng, out, prev = random.Random(seed), [], None
    for _ in range(count):
        prev = rng.choice([m for m in range(n) if m != prev] or [0])
        out.append(prev)
    return out


def downsample(series, points=SERIES_POINTS):
    """At most `points` samples: of each run of consecutive samples, the largest (a peak stays)."""
    if len(series) <= points:
        return [list(x) for x in series]
    k = -(-len(series) // points)
    return [list(max(series[i:i + k], key=lambda x: x[1])) for i in range(0, len(series), k)]


def window(series, t0, t1):
    return [(t, x) for t, x in series if t0 <= t <= t1]


def burst_time_over(series, bursts, budget, after=False):
    """Seconds over the budget in each burst: from its start (after=True: from its last answer, i.e. once
    every holder is out of its call and the debt must be repaid) to the next burst's start (the last: its
    end + 1 s)."""
    out = []
    for k, (b0, b1) in enumerate(bursts):
        end = bursts[k + 1][0] if k + 1 < len(bursts) else b1 + 1.0
        start = b1 if after else b0
        out.append(round(over_budget([(t, x) for t, x in series if start <= t < end], budget)[1], 3))
    return out


def pattern_stats(reqs, series, budget, t0, t1, bursts=None):
    dts = sorted(r["dt"] for r in reqs)
    sw = sorted(r["dt"] for r in reqs if r["switch"])
    q = lambda xs, f: round(quantile(xs, f), 4) if xs else None
    status = {}
    for r in reqs:
        status[str(r.get("status"))] = status.get(str(r.get("status")), 0) + 1
    win = window(series, t0, t1)
    st = {"requests": len(reqs), "switches": len(sw), "errors": sum(1 for r in reqs if "error" in r), "http_status": status,
          "request_s_p50": q(dts, 0.5), "request_s_p99": q(dts, 0.99), "request_s_max": q(dts, 1.0),
          "switch_s_p50": q(sw, 0.5), "switch_s_p99": q(sw, 0.99), "switch_s_max": q(sw, 1.0),
          "samples": len(win), "max_sum_mib": max((x for _, x in win), default=None), "duration_s": round(t1 - t0, 2)}
    if budget is not None:
        ex, over = over_budget(win, budget)
        st["max_excess_mib"] = round(ex, 1) if ex else 0
        st["time_over_s"] = round(over, 3)
        if bursts is not None:
            st["burst_time_over_s"] = burst_time_over(series, bursts, budget)
            st["burst_time_over_after_s"] = burst_time_over(series, bursts, budget, after=True)
            st["burst_s"] = [round(b1 - b0, 3) for b0, b1 in bursts]
    return st


# ---- the router ---------------------------------------------------------------------------------

class Router:
    """llama-server in router mode, in a process group of its own; `pids` gathers the router and every
    child it ever had (polled every 0.2 s), for the GPU sum."""

    def __init__(self, a, config, models_dir, models_max, env, log_path):
        self.url = f"http://127.0.0.1:{a.port}"
        self.timeout = a.timeout
        self.log_path = log_path
        self.lf = open(log_path, "w")
        cmd = [f"{a.llama}/bin/llama-server", "--models-dir", models_dir, "--models-max", str(models_max),
               "-ngl", "0" if a.no_gpu else "999", "-c", "1024", "-np", "1", "--port", str(a.port)]
        log(config, "router:", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.lf, stderr=subprocess.STDOUT, start_new_session=True)
        self.pids = {self.proc.pid}
        self._stop = threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self):
        while not self._stop.is_set():
            self.pids.update(descendants(self.proc.pid))
            self._stop.wait(0.2)

    def get(self, path, timeout=5):
        return json.loads(urllib.request.urlopen(self.url + path, timeout=timeout).read())

    def wait_ready(self, limit=120):
        end = time.time() + limit
        while time.time() < end and self.proc.poll() is None:
            try:
                return self.get("/models")
            except Exception:
                time.sleep(0.2)
        return None

    def ask(self, model_id, who):
        return complete(self.url + "/completion", request_body(model_id), who, timeout=self.timeout)

    def children(self):
        return [p for p in descendants(self.proc.pid) if alive(p)]

    def close(self):
        self._stop.set()
        kids = descendants(self.proc.pid)
        self.pids.update(kids)
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        end = time.time() + 15
        while time.time() < end and any(alive(k) for k in kids):
            time.sleep(0.1)
        for k in kids:
            if alive(k):
                try:
                    os.kill(k, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.lf.close()


def host_bytes(a, router, stems, files, with_stat):
    """Each child's RSS, locked and pinned host bytes, each GGUF's page-cache bytes, /proc/meminfo."""
    out = {"servers": [], "page_cache": {}, "meminfo": meminfo()}
    budgets = run_json([a.tool, "stat", "--json"]) if with_stat else {}
    holders = {}
    for b in budgets.get("shared_budgets", []) or []:
        for h in b.get("holders", []) or []:
            holders[h.get("pid")] = dict(h, budget=b.get("name"))
    if "error" in budgets:
        out["stat_error"] = budgets["error"]
    for pid in router.children():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        model = next((k for k, fp in enumerate(files) if fp in cmdline or os.path.realpath(fp) in cmdline), None)
        s = {"pid": pid, "model": stems[model] if model is not None else None,
             "model_bytes": os.path.getsize(files[model]) if model is not None else None}
        s.update(proc_status(pid))
        if with_stat:
            j = run_json([a.tool, "stat", "--json", "--pid", str(pid)])
            if "error" in j:
                s["stat_error"] = j["error"]
            mans = [m.get("state", {}) for m in j.get("managers", []) or [] if not m.get("stale") and not m.get("error")]
            s["managers"] = [{k: m.get(k) for k in ("manager", "backend", "resident", "pinned_host_bytes", "tracked_bytes",
                                                    "wired_bytes", "rewires", "last_rewire_ms", "shared_budget", "shared_held")
                              if k in m} for m in mans]
            h = holders.get(pid)
            if h is not None:
                s["holder"] = {k: h.get(k) for k in ("budget", "state", "bytes", "pinned_host_bytes", "switches",
                                                     "last_switch_ms")}
            # The managers' own account first (a manager that pins nothing writes no field: 0); else the budget's.
            if mans:
                s["pinned_host_bytes"] = sum(int(m.get("pinned_host_bytes") or 0) for m in mans)
            elif h is not None:
                s["pinned_host_bytes"] = int(h.get("pinned_host_bytes") or 0)
            else:
                s["pinned_host_bytes"] = None
            g = j.get("gpu", {}).get("processes") if isinstance(j.get("gpu"), dict) else None
            if g:
                s["gpu_used_bytes"] = sum(int(u.get("used") or 0) for u in g)
        out["servers"].append(s)
    for stem, fp in zip(stems, files):
        out["page_cache"][stem] = {"file_bytes": os.path.getsize(fp), "cached_bytes": page_cache_bytes(fp)}
    return out


def scan_log(path):
    """Out-of-memory lines in the router's log (its children's output is forwarded to it): llama.cpp's,
    and residency's own (counted apart: lines of a wake it then handled)."""
    engine, own, examples, res_lines = 0, 0, [], []
    try:
        with open(path, errors="replace") as f:
            for line in f:
                line = line.rstrip()
                if "residency[" in line:
                    res_lines.append(line)
                low = line.lower()
                if "out of memory" in low or "cudamalloc failed" in low:
                    if "residency[" in line:
                        own += 1
                    else:
                        engine += 1
                        if len(examples) < 5:
                            examples.append(line[-300:])
    except OSError:
        pass
    return {"oom_lines_engine": engine, "oom_lines_residency": own, "oom_examples": examples}, res_lines


def run_config(a, cfg, stems, files, models_dir, sampler, budget_mib, budget_name, order):
    """One configuration: start the router, load every model once, run the patterns, measure the host
    bytes, stop. Returns its record (also written to DIR/config-CFG.json)."""
    ph = {}
    tc = time.time()
    rec = {"config": cfg, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host_cpu": host_cpu(), "key": model_key(files),
           "models_max": 0 if cfg != "plain" else a.plain_models_max, "preload": cfg in PRELOADED,
           "budget": a.budget if cfg in PRELOADED else None, "budget_mib": budget_mib,
           "budget_wait": a.budget_wait if cfg == "strict" else ("over" if cfg == "residency" else None),
           "hog_gib": a.hog_gib if cfg != "resident" and not a.no_gpu else 0, "requests_per_pattern":
           a.plain_requests if cfg == "plain" else a.requests, "seed": a.seed, "no_gpu": a.no_gpu}
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("RESIDENCY_")}
    if cfg in PRELOADED:
        env.update(LD_PRELOAD=a.preload, RESIDENCY_KEEP_ALIVE="10m", RESIDENCY_LOG=a.log_level, RESIDENCY_LOG_TIME="1",
                   RESIDENCY_GPU_BUDGET=f"{budget_name}:{a.budget}", RESIDENCY_BUDGET_WAIT=rec["budget_wait"])
        log(cfg, "RESIDENCY_GPU_BUDGET=" + env["RESIDENCY_GPU_BUDGET"], "RESIDENCY_BUDGET_WAIT=" + rec["budget_wait"])
    hog = router = None
    try:
        t = time.time()
        hog = start_hog(rec["hog_gib"])
        ph["hog_s"] = round(time.time() - t, 2)
        t = time.time()
        t_start = t
        router = Router(a, cfg, models_dir, rec["models_max"], env, f"{a.dir}/router-{cfg}.log")
        listing = router.wait_ready()
        ph["start_s"] = round(time.time() - t, 2)
        log(cfg, f"router up in {ph['start_s']} s" if listing is not None else "router did not start")
        if listing is None:
            rec["error"] = "the router did not start (see " + router.log_path + ")"
            return rec
        ids = [m.get("id") for m in listing.get("data", [])]
        log(cfg, "GET /models ids:", ids)
        rec["model_ids"] = ids
        missing = [s for s in stems if s not in ids]
        if missing:
            rec["error"] = f"the router does not list {missing}"
            log(cfg, rec["error"])
            return rec
        rel = lambda x: round(x - t_start, 3)
        state = {"prev": None}

        def ask(m, is_switch=None):
            r = router.ask(stems[m], f"{cfg} {stems[m]}")
            sw = (m != state["prev"]) if is_switch is None else is_switch
            state["prev"] = m
            r = dict(r, model=m, switch=sw, t=rel(r["t"]), dt=round(r["dt"], 4))
            r.setdefault("status", 200)
            return r

        t = time.time()
        rec["warmup"] = [ask(m) for m in range(len(stems))]
        ph["warmup_s"] = round(time.time() - t, 2)
        rec["warmup_window"] = [rel(t), rel(time.time())]
        log(cfg, "warm-up (loads):", [r["dt"] for r in rec["warmup"]], f"{ph['warmup_s']} s")
        n = len(stems)
        nreq = rec["requests_per_pattern"]
        pats = [x for x in a.patterns if cfg != "plain" or x in PLAIN_PATTERNS]
        rec["patterns"] = {}
        for pat in pats:
            t0 = time.time()
            bursts = None
            if pat == "rr0":
                reqs = [ask(k % n) for k in range(nreq)]
            elif pat == "rr1.6":
                reqs = []
                for k in range(nreq):
                    if k:
                        time.sleep(1.6)
                    reqs.append(ask(k % n))
            elif pat == "random":
                reqs = [ask(m) for m in order[:nreq]]
            else:
                reqs, bursts, lock = [], [], threading.Lock()
                for b in range(max(1, nreq // n)):
                    if b and pat == "burst":
                        time.sleep(1.0)
                    b0 = time.time()

                    def go(m):
                        r = ask(m, True)
                        with lock:
                            reqs.append(r)

                    th = [threading.Thread(target=go, args=(m,), daemon=True) for m in range(n)]
                    for x in th:
                        x.start()
                    for x in th:
                        x.join()
                    bursts.append([rel(b0), rel(time.time())])
            t1 = time.time()
            ph[pat + "_s"] = round(t1 - t0, 2)
            rec["patterns"][pat] = {"window": [rel(t0), rel(t1)], "requests": reqs}
            if bursts is not None:
                rec["patterns"][pat]["bursts"] = bursts
            sw = sorted(r["dt"] for r in reqs if r["switch"])
            log(cfg, pat, f"{len(reqs)} requests, {len(sw)} switches, {sum(1 for r in reqs if 'error' in r)} errors,",
                f"switch p50 {quantile(sw, 0.5) if sw else None} s, {ph[pat + '_s']} s")
        t = time.time()
        rec["host"] = host_bytes(a, router, stems, files, with_stat=True)
        ph["host_s"] = round(time.time() - t, 2)
        log(cfg, "host bytes:", json.dumps([{k: s.get(k) for k in ("pid", "model", "vm_rss", "vm_lck", "pinned_host_bytes")}
                                            for s in rec["host"]["servers"]]))
    finally:
        t = time.time()
        if router is not None:
            router.close()
            rec["log_scan"], _ = scan_log(router.log_path)
        if hog is not None:
            hog.kill()
            hog.wait()
        ph["stop_s"] = round(time.time() - t, 2)
        rec["phases_s"] = ph
        rec["wall_s"] = round(time.time() - tc, 2)
        if router is not None:
            pids = set(router.pids)
            rec["pids"] = sorted(pids)
            rec["series"] = [[round(t - t_start, 3), x] for t, x in sums(sampler.samples, pids, t_start)] if sampler else []
            # Each sample over the budget, process by process (at most 400): who held what then.
            b = rec.get("budget_mib")
            rec["over_samples"] = [] if not sampler or b is None else [
                [round(t - t_start, 3), {str(p): v for p, v in smp.items() if p in pids}]
                for t, smp in sampler.samples if t >= t_start and sum(v for p, v in smp.items() if p in pids) > b][:400]
        log(cfg, "phases (s):", json.dumps(ph), f"total {rec['wall_s']} s")
    with open(f"{a.dir}/config-{cfg}.json", "w") as f:
        json.dump(rec, f)
    return rec


def model_key(files):
    return [[os.path.basename(f), os.path.getsize(f), int(os.path.getmtime(f))] for f in files]


def load_cached(a, cfg, files):
    path = f"{a.dir}/config-{cfg}.json"
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if rec.get("key") != model_key(files):
        log(cfg, "cached result", path, "is of other models: not reported")
        return None
    rec["from_cache"] = path
    return rec


# ---- the report ---------------------------------------------------------------------------------

def all_requests(rec):
    yield "warmup", rec.get("warmup", [])
    for pat, p in rec.get("patterns", {}).items():
        yield pat, p["requests"]


def report(a, recs, stems, files, budget_mib, gpu):
    """The JSON (with its checks), the CSV and the residency lines, from the configurations' records."""
    ref_rec = recs.get("resident")
    reference = None
    if ref_rec and len(ref_rec.get("warmup", [])) == len(stems) and all("error" not in r for r in ref_rec["warmup"]):
        reference = {r["model"]: answer_from_json(r) for r in ref_rec["warmup"]}
    configs, series_out, mismatches = {}, {}, []
    for cfg, rec in recs.items():
        c = {k: rec.get(k) for k in ("date", "from_cache", "error", "models_max", "preload", "budget", "hog_gib",
                                     "requests_per_pattern", "seed", "no_gpu", "model_ids", "phases_s", "wall_s", "log_scan",
                                     "host", "budget_wait", "over_samples") if k in rec}
        series = [tuple(x) for x in rec.get("series", [])]
        compared = equal = 0
        for pat, reqs in all_requests(rec):
            for k, r in enumerate(reqs):
                if reference is None:
                    r["answer_ok"] = None
                    continue
                ok = same_answer(answer_from_json(r), reference[r["model"]])
                r["answer_ok"] = ok
                compared += 1
                equal += ok
                if not ok and len(mismatches) < 8:
                    mismatches.append({"config": cfg, "pattern": pat, "i": k, "model": stems[r["model"]],
                                       "error": r.get("error"), "tokens": r.get("tokens"), "probs": r.get("probs")})
        c["answers_compared"], c["answers_equal"] = compared, equal
        wu = rec.get("warmup", [])
        if wu:
            c["warmup"] = {"requests": len(wu), "load_s": [r["dt"] for r in wu],
                           "errors": sum(1 for r in wu if "error" in r)}
        c["patterns"], c["requests"] = {}, {}
        for pat, p in rec.get("patterns", {}).items():
            t0, t1 = p["window"]
            st = pattern_stats(p["requests"], series, rec.get("budget_mib", budget_mib), t0, t1, p.get("bursts"))
            st["answers_equal"] = None if reference is None else all(r["answer_ok"] for r in p["requests"])
            ref_p = (ref_rec or {}).get("patterns", {}).get(pat)
            st["warm_s_p50"] = round(quantile(sorted(r["dt"] for r in ref_p["requests"]), 0.5), 4) if ref_p and ref_p["requests"] else None
            c["patterns"][pat] = st
            # [model, t_s, dt_s, switch, HTTP status, answer equal to the reference]
            c["requests"][pat] = [[r["model"], r["t"], r["dt"], r["switch"], r.get("status"), r.get("answer_ok")]
                                  for r in p["requests"]]
        configs[cfg] = c
        series_out[cfg] = downsample(series)

    # ---- checks ----
    checks = []
    res = configs.get("residency")
    resp = (res or {}).get("patterns", {})

    # 1. budget
    if res is None or recs["residency"].get("budget_mib", budget_mib) is None:
        ok, detail = False, "the residency configuration did not run" if res is None else "no budget in MiB (no GPU)"
    else:
        parts, ok = [], True
        for pat, st in resp.items():
            if st["samples"] == 0:
                ok = False
                parts.append(f"{pat}: no GPU samples")
            elif pat in BURSTS:
                after = st.get("burst_time_over_after_s")
                worst = max(after or [0])
                ok = ok and after is not None and worst <= 0.25
                parts.append(f"{pat}: largest excess {st['max_excess_mib']} MiB while every holder was in a call; time over per "
                             f"burst {st.get('burst_time_over_s')} s, bursts lasted {st.get('burst_s')} s; over after a "
                             f"burst's last answer {after} s (largest {worst} s, at most 0.25 s: repaid as the calls end)")
            else:
                ok = ok and st["max_excess_mib"] == 0
                parts.append(f"{pat}: largest excess {st['max_excess_mib']} MiB over {st['samples']} samples")
        ok = ok and bool(resp)
        detail = "; ".join(parts) or "no pattern ran"
    checks.append({"check": "budget held under residency: largest excess 0 MiB in rr0, rr1.6 and random; in bursts, over only "
                            "while every holder was in a call, and back under it within 0.25 s of a burst's last answer "
                            "(50 ms nvidia-smi samples of the router's processes)", "ok": ok, "detail": detail})

    # 1b. the strict budget: 0 MiB over in every pattern, bursts included; its burst latency against
    # the opt-in's (going over)
    strict = configs.get("strict")
    stp = (strict or {}).get("patterns", {})
    if strict is None or recs["strict"].get("budget_mib", budget_mib) is None:
        ok, detail = False, "the strict configuration did not run" if strict is None else "no budget in MiB (no GPU)"
    else:
        parts, ok = [], bool(stp)
        for pat, st in stp.items():
            ok = ok and st["samples"] > 0 and st["max_excess_mib"] == 0
            line = f"{pat}: largest excess {st['max_excess_mib']} MiB over {st['samples']} samples, requests p50 " \
                   f"{st['request_s_p50']} s p99 {st['request_s_p99']} s"
            over = resp.get(pat)
            if over is not None:
                line += f" (going over: excess {over['max_excess_mib']} MiB, p50 {over['request_s_p50']} s p99 " \
                        f"{over['request_s_p99']} s)"
            parts.append(line)
        errs = sum(1 for _, reqs in all_requests(recs["strict"]) for r in reqs if "error" in r)
        ok = ok and errs == 0
        parts.append(f"{errs} failed requests")
        detail = "the GPU sum of the router's processes (nvidia-smi every 50 ms) under RESIDENCY_BUDGET_WAIT=" \
                 f"{a.budget_wait}: " + "; ".join(parts)
    checks.append({"check": "budget_burst", "ok": ok, "detail": detail})

    # 2. switch time against the link
    size = max(os.path.getsize(f) for f in files)
    link_s = size / (a.link_gbs * 1e9)
    parts, ok = [], res is not None and any(p in resp for p in SEQUENTIAL)
    for pat in SEQUENTIAL:
        st = resp.get(pat)
        if st is None:
            continue
        if st["switch_s_p50"] is None or st["warm_s_p50"] is None:
            ok = False
            parts.append(f"{pat}: switch p50 {st['switch_s_p50']}, warm p50 {st['warm_s_p50']} (the resident router's)")
            continue
        limit = 1.15 * link_s + st["warm_s_p50"]
        ok = ok and st["switch_s_p50"] <= limit
        parts.append(f"{pat}: switch p50 {st['switch_s_p50']} s against {limit:.4f} s")
    checks.append({"check": f"switch p50 under residency <= 1.15 x size/link + warm p50 (size {size} B, link {a.link_gbs} GB/s: "
                            f"{link_s:.4f} s; warm p50: the resident router's, same pattern)", "ok": ok,
                   "detail": "; ".join(parts) or "the residency configuration did not run"})

    # 3. against the plain router
    plain = configs.get("plain")
    parts, ok = [], False
    if res is not None and plain is not None:
        common = [p for p in PLAIN_PATTERNS if p in resp and p in plain["patterns"]]
        ok = bool(common)
        for pat in common:
            x, y = resp[pat]["switch_s_p50"], plain["patterns"][pat]["switch_s_p50"]
            ok = ok and x is not None and y is not None and x < y
            parts.append(f"{pat}: {x} s against the plain router's {y} s")
    checks.append({"check": "switch p50 under residency < the plain router's switch p50 (--models-max "
                            f"{a.plain_models_max}), same pattern", "ok": ok,
                   "detail": "; ".join(parts) or "residency or plain did not run, or no pattern in common"})

    # 4. pinned host bytes
    parts, ok = [], False
    servers = ((res or {}).get("host") or {}).get("servers", [])
    if servers:
        ok = True
        for s in servers:
            mb = s.get("model_bytes")
            pinned = s.get("pinned_host_bytes")
            if mb is None or pinned is None:
                ok = False
                parts.append(f"pid {s['pid']} ({s.get('model')}): pinned host bytes unknown")
                continue
            limit = a.kv_compute_mib * MiB + 0.05 * mb
            ok = ok and pinned <= limit
            parts.append(f"{s.get('model')}: pinned {pinned / MiB:.1f} MiB against {limit / MiB:.1f} MiB")
    checks.append({"check": f"pinned host bytes per server <= KV+compute ({a.kv_compute_mib:g} MiB) + 5 % of its model "
                            "(residency stat, after the patterns)", "ok": ok,
                   "detail": "; ".join(parts) or "no residency server measured"})

    # 5. answers
    total = sum(c["answers_compared"] for c in configs.values())
    eq = sum(c["answers_equal"] for c in configs.values())
    checks.append({"check": "answers equal to the resident router's (tokens and top-5 log-probs) for every request, "
                            "warm-up loads included", "ok": reference is not None and total > 0 and eq == total,
                   "detail": f"{eq} of {total} equal" if reference is not None else "no reference: the resident router did not run"})

    # 6. errors
    errs = {cfg: sum(1 for _, reqs in all_requests(recs[cfg]) for r in reqs if "error" in r) for cfg in recs}
    oom = {cfg: (c.get("log_scan") or {}).get("oom_lines_engine") for cfg, c in configs.items()}
    own = {cfg: (c.get("log_scan") or {}).get("oom_lines_residency") for cfg, c in configs.items()}
    checks.append({"check": "no HTTP error, no out-of-memory line from llama.cpp ('out of memory', 'cudaMalloc failed'; "
                            "residency's own lines counted apart)",
                   "ok": bool(recs) and all(v == 0 for v in errs.values()) and all(v == 0 for v in oom.values())
                   and not any(c.get("error") for c in configs.values()),
                   "detail": f"failed requests {errs}; llama.cpp out-of-memory lines {oom}; residency's {own}"
                             + "".join(f"; {k}: {c['error']}" for k, c in configs.items() if c.get("error"))})

    cpus = sorted({r["host_cpu"] for r in recs.values() if r.get("host_cpu")})
    doc = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "host_cpu": ", ".join(cpus) or host_cpu(), "llama": a.llama,
           "models": len(files), "model_size": a.size, "model_files": [[os.path.basename(f), os.path.getsize(f)] for f in files],
           "model_ids": stems, "budget": a.budget, "budget_mib": budget_mib, "hog_gib": a.hog_gib, "keep_alive": "10m",
           "link_gbs": a.link_gbs, "kv_compute_mib": a.kv_compute_mib, "requests": a.requests,
           "plain_requests": a.plain_requests, "seed": a.seed, "random_order": None,
           "switch": "a request to another model than the previous request's (in a burst: every request); its time: "
                     "the request's wall time",
           "configs": configs,
           "reference_answers": {stems[m]: {"tokens": r["tokens"], "probs": r["probs"]} for m, r in reference.items()}
           if reference else None,
           "answer_mismatches": mismatches,
           "series_note": f"[t_s from the router's start, summed MiB of the router and its children]; at most {SERIES_POINTS} "
                          "points per configuration (of each run of samples, the largest); all samples in the .csv",
           "series": series_out, "checks": checks}
    return doc


def write_csv(path, recs, budget_mib):
    with open(path, "w") as f:
        f.write("config,pattern,t_s,gpu_mib,budget_mib\n")
        for cfg, rec in recs.items():
            b = rec.get("budget_mib", budget_mib)
            wins = [(p["window"][0], p["window"][1], pat) for pat, p in rec.get("patterns", {}).items()]
            if rec.get("warmup_window"):
                wins.append((rec["warmup_window"][0], rec["warmup_window"][1], "warmup"))
            for t, x in rec.get("series", []):
                pat = next((w for t0, t1, w in wins if t0 <= t <= t1), "-")
                f.write(f"{cfg},{pat},{t},{x},{'' if b is None else round(b, 1)}\n")


def main():
    a = parse_args()
    t_main = time.time()
    models_dir = f"{a.dir}/models"
    os.makedirs(models_dir, exist_ok=True)
    base = os.path.splitext(a.out)[0]
    if a.no_gpu:
        total_mib, gpu = None, "none (--no-gpu)"
        budget_mib = None if a.budget.endswith("%") else parse_budget_mib(a.budget, 0)
    else:
        total_mib, gpu = gpu_total_mib(), gpu_name()
        budget_mib = parse_budget_mib(a.budget, total_mib)
    log("GPU:", gpu, "budget:", a.budget, f"= {budget_mib} MiB" if budget_mib is not None else "")
    t = time.time()
    if a.mix:
        files = []
        for i, spec in enumerate(a.mix.split(",")):
            size, wtype, *seed = spec.split(":")
            name = f"{models_dir}/mix-{i}-{size}-{wtype}.gguf"
            files.append(make_model(a.tool, name, size, int(seed[0]) if seed else 100 + i, wtype))
        a.models, a.size = len(files), "mixed"
    else:
        files = [make_model(a.tool, f"{models_dir}/model-{i}.gguf", a.size, 100 + i) for i in range(a.models)]
    stems = [os.path.basename(f)[:-len(".gguf")] for f in files]
    extra = [x for x in os.listdir(models_dir) if x.endswith(".gguf") and x[:-5] not in stems]
    if extra:
        log("note: the router will also list", extra, "(other GGUFs in", models_dir + "); they get no requests")
    log(f"models ready in {time.time() - t:.1f} s:", stems)
    order = random_order(a.seed, len(files), max(a.requests, a.plain_requests))
    sampler = None if a.no_gpu else GpuSampler(50).start()
    budget_name = f"router{os.getpid()}"
    recs = {}

    def write():
        have = {}
        for cfg in CONFIGS:
            if cfg in recs:
                have[cfg] = recs[cfg]
            elif not a.no_reuse:
                c = load_cached(a, cfg, files)
                if c is not None:
                    have[cfg] = c
        doc = report(a, have, stems, files, budget_mib, gpu)
        doc["random_order"] = [stems[m] for m in order]
        doc["configs_run"] = list(recs)
        doc["wall_s"] = round(time.time() - t_main, 1)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        write_csv(base + ".csv", have, budget_mib)
        with open(base + ".log", "w") as f:
            for cfg in have:
                _, lines = scan_log(f"{a.dir}/router-{cfg}.log")
                f.writelines(f"{cfg}: {l}\n" for l in lines)
        return doc

    try:
        for cfg in a.configs:
            log("==", cfg)
            recs[cfg] = run_config(a, cfg, stems, files, models_dir, sampler, budget_mib, budget_name, order)
            write()
        doc = write()
    finally:
        if sampler:
            sampler.stop()
    for c in doc["checks"]:
        log("check", "ok  " if c["ok"] else "FAIL", c["check"], "--", c.get("detail", ""))
    log("wrote", a.out, base + ".csv", base + ".log", f"in {time.time() - t_main:.1f} s")


def _terminate(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    try:
        main()
    except KeyboardInterrupt:
        log("interrupted: the router and the hog were stopped; finished configurations are in DIR/config-*.json")
        sys.exit(130)
