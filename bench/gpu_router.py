#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""llama.cpp's own router under a GPU budget (issue item 5). On a machine with an NVIDIA GPU.

`llama-server --models-dir DIR` (router mode) with N make-model models of SIZE, all layers on the
GPU, in up to three configurations, run in the order given:
  resident   --models-max 0, no preload: every model loaded once and kept; its answers are the
             reference and its request times the warm times
  plain      --models-max 2 (--plain-models-max), no preload: the router unloads the least recently
             used model and loads the next (about 3 s a switch): runs rr0, random and prompt_cache only
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
  prompt_cache  does a model's prompt cache survive a switch away and back? Needs 3 models or more and
          --ctx >= --prompt-tokens + 256 (4096 for the default 3000). Before it: /tokenize on the first
          model A sizes one long prompt per round (numbered sentences, a new first word each round, so
          each round's first request is a real prefill) to the first sentence count of at least
          --prompt-tokens tokens, then one short request makes A current. Each of --prompt-rounds
          rounds: the long prompt to A (a prefill; A current, no switch); one short request to each
          other model (under plain --models-max 2 the router unloads A; under a budget for two A
          sleeps, weights and KV cache); A's state recorded (GET /models, `residency stat --json`);
          the same prompt extended by a follow-up of about 50-100 tokens to A. The long requests:
          streamed (time to first token: the first token's event), cache_prompt true, n_predict 4,
          greedy, top-5 log-probs; each records llama-server's timings (prompt_n: tokens processed,
          cache_n: tokens reused from the slot, prompt_ms), tokens_evaluated (the prompt's tokens)
          and tokens_cached (what the slot holds after the answer: prompt + answer - 1, large either
          way). `-np 1`: one slot, which holds A's cache. The check prompt_cache: under the
          preloaded configurations every follow-up processed at most its extension + 16 tokens and
          A was asleep before it, every first prompt >= 2048 tokens, and (when plain ran) the
          follow-up's time to first token p50 below the plain router's, whose A was unloaded.
          Also OUT's -prompt-cache.csv (one row per request).
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
      [--ctx 1024] [--prompt-tokens 3000] [--prompt-rounds 3]
Uses only the Python standard library; shares gpu_bench.py (beside it) with gpu_budget_servers.py.
"""
import argparse, ctypes, json, os, random, signal, subprocess, sys, threading, time, urllib.error, urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import (MiB, GpuSampler, answer_from_json, budget_mib as parse_budget_mib, complete, gpu_name,  # noqa: E402
                       gpu_total_mib, host_cpu, log, make_model, over_budget, quantile, request_body, same_answer,
                       start_hog, sums)

CONFIGS = ("resident", "plain", "residency", "strict")
PRELOADED = ("residency", "strict")
PATTERNS = ("rr0", "rr1.6", "random", "burst", "burst0", "prompt_cache")
BURSTS = ("burst", "burst0")
PLAIN_PATTERNS = ("rr0", "random", "prompt_cache")  # the plain router pays seconds per switch
PROMPT_MIN_TOKENS = 2048  # the prompt_cache pattern's long prompt, at least
PROMPT_CTX_MARGIN = 256   # --ctx >= --prompt-tokens + this: the follow-up, the answer, a sentence's overshoot
PROMPT_SLACK = 16         # a follow-up that reused the cache processes at most its extension + this
PROMPT_PREDICT = 4        # tokens answered to each long prompt
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
    p.add_argument("--warm-s", type=float, default=None, help="the warm request time (s) for the switch checks when the "
                   "resident router did not run here (models that do not all fit the GPU): measure it with fewer models")
    p.add_argument("--hardlinks", action="store_true", help="--models names of one file (hard links): models larger than "
                   "the disk holds N times; the servers share its page cache")
    p.add_argument("--mix", default="", help="models of mixed size and type instead of --models x --size F16: "
                   "SIZE:TYPE[:SEED],... (12GiB:f16,12GiB:q8_0,12GiB:f16:100,8GiB:q8_0; the same seed, type and size: "
                   "the same bytes in another file)")
    p.add_argument("--budget", default="28GiB", help="RESIDENCY_GPU_BUDGET's size: NGiB or N%% (of the GPU)")
    p.add_argument("--hog-gib", type=float, default=0,
                   help="a PyTorch process outside the budget holds this much first (plain and residency; the "
                        "resident router, which needs every model at once, runs without it)")
    p.add_argument("--configs", default="resident,plain,residency", help="comma list of " + ",".join(CONFIGS))
    p.add_argument("--host-budget", default="", help="the preloaded configurations' RESIDENCY_HOST_BUDGET size (the "
                   "host tier: registered model files); its ledger is NAME-host; sampled every 250 ms; check host_tier")
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
    p.add_argument("--ctx", type=int, default=1024, help="the router's -c (each child's context; one slot, -np 1): "
                   "prompt_cache needs --prompt-tokens + 256 (4096 for the default)")
    p.add_argument("--prompt-tokens", type=int, default=3000,
                   help="prompt_cache: each round's long prompt, at least this many tokens (2048 at least)")
    p.add_argument("--prompt-rounds", type=int, default=3, help="prompt_cache: rounds (long prompt, switches, follow-up)")
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
    if "prompt_cache" in a.patterns:
        if a.prompt_tokens < PROMPT_MIN_TOKENS:
            p.error(f"--prompt-tokens {a.prompt_tokens}: prompt_cache needs {PROMPT_MIN_TOKENS} or more")
        if a.ctx < a.prompt_tokens + PROMPT_CTX_MARGIN:
            p.error(f"--patterns prompt_cache with --ctx {a.ctx}: needs --ctx {a.prompt_tokens + PROMPT_CTX_MARGIN} or "
                    f"more (--prompt-tokens {a.prompt_tokens} + {PROMPT_CTX_MARGIN})")
        if a.prompt_rounds < 1:
            p.error("--prompt-rounds: 1 or more")
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


# The prompt_cache pattern's prompts: deterministic, one long prompt per round with its own first word
# (so that no round's prompt shares more than the BOS with the one before it in the slot), and a follow-up
# that extends it.
ROUND_WORDS = ("Amber", "Birch", "Cedar", "Delta", "Ember", "Fjord", "Grove", "Harbor", "Iris", "Juniper")
_ADJ = ("quiet", "bright", "narrow", "heavy", "silver", "distant", "careful", "ancient", "sudden", "gentle")
_NOUN = ("river", "lantern", "garden", "engine", "letter", "bridge", "market", "window", "signal", "ladder")
_VERB = ("passes", "guards", "follows", "crosses", "measures", "carries", "watches", "reaches")
_PLACE = ("the old mill", "the north gate", "the long pier", "the hill road", "the stone well", "the east tower")


def long_prompt(rnd, sentences):
    """Round `rnd`'s long prompt of `sentences` numbered notes (the first k notes of any length are the same)."""
    rng = random.Random(9001 + rnd)
    out = [f"{ROUND_WORDS[rnd % len(ROUND_WORDS)]} log, part {rnd + 1}. Read every numbered note."]
    for i in range(sentences):
        out.append(f"Note {i + 1}: the {rng.choice(_ADJ)} {rng.choice(_NOUN)} {rng.choice(_VERB)} {rng.randrange(2, 99)} "
                   f"{rng.choice(_NOUN)}s near {rng.choice(_PLACE)}.")
    return " ".join(out)


def follow_up(rnd):
    """What round `rnd`'s follow-up appends to its long prompt (about 50-100 tokens)."""
    return (f" Question {rnd + 1}: of all the notes above, which note names the most distant place, which one names "
            "the largest number, and which two notes share a noun? Answer in one short line.")


def size_prompt(count, rnd, target):
    """(text, tokens): round `rnd`'s long prompt with the fewest notes whose text is at least `target` tokens by
    `count(text)` (the model's /tokenize; tokens without the BOS). When `count` answers None: about 2 characters
    a token (the smallest synthetic vocabulary's rate), and tokens None."""
    k0 = 20
    n = count(long_prompt(rnd, k0))
    if n is None or n <= 0:
        per = len(long_prompt(rnd, k0)) / k0
        k = max(1, int(target * 2 / per) + 1)
        return long_prompt(rnd, k), None
    k = max(1, -(-target * k0 // n))
    n = count(long_prompt(rnd, k))
    for _ in range(400):
        if n is None:
            return long_prompt(rnd, k), None
        if n < target:
            k += 1
            n = count(long_prompt(rnd, k))
            continue
        m = count(long_prompt(rnd, k - 1)) if k > 1 else None
        if m is None or m < target:
            break
        k, n = k - 1, m
    return long_prompt(rnd, k), n


def prompt_body(model, text):
    """A long request of the prompt_cache pattern: streamed, the slot's cache reused, 4 greedy tokens."""
    return {"prompt": text, "n_predict": PROMPT_PREDICT, "temperature": 0, "n_probs": 5, "cache_prompt": True,
            "seed": 1, "stream": True, "model": model}


def _q50(xs):
    xs = sorted(x for x in xs if x is not None)
    return round(quantile(xs, 0.5), 4) if xs else None


def prompt_cache_summary(reqs):
    """Per round, the long prompt's and its follow-up's figures; the extension: the follow-up's prompt tokens
    minus the long prompt's (tokens_evaluated)."""
    rounds = sorted({r["round"] for r in reqs if r.get("kind") in ("prefill", "followup")})
    pre, fu = {"tokens_evaluated": [], "prompt_n": [], "cache_n": [], "ttft_s": [], "prompt_ms": [], "wall_s": []}, \
        {"extension_tokens": [], "tokens_evaluated": [], "prompt_n": [], "cache_n": [], "tokens_cached": [], "ttft_s": [],
         "prompt_ms": [], "wall_s": [], "a_before": []}
    for rnd in rounds:
        p = next((r for r in reqs if r.get("round") == rnd and r.get("kind") == "prefill"), {})
        f = next((r for r in reqs if r.get("round") == rnd and r.get("kind") == "followup"), {})
        for d, r in ((pre, p), (fu, f)):
            for k in ("tokens_evaluated", "prompt_n", "cache_n", "prompt_ms"):
                d[k].append(r.get(k))
            d["ttft_s"].append(r.get("ttft"))
            d["wall_s"].append(r.get("dt"))
        fu["tokens_cached"].append(f.get("tokens_cached"))
        fu["a_before"].append(f.get("a_before"))
        te_p, te_f = p.get("tokens_evaluated"), f.get("tokens_evaluated")
        fu["extension_tokens"].append(te_f - te_p if isinstance(te_p, int) and isinstance(te_f, int) else None)
    for d in (pre, fu):
        for k in ("ttft_s", "prompt_ms", "wall_s"):
            d[k + "_p50"] = _q50(d[k])
    return {"rounds": len(rounds), "prefill": pre, "followup": fu,
            "errors": sum(1 for r in reqs if r.get("kind") in ("prefill", "followup") and "error" in r)}


# ---- the router ---------------------------------------------------------------------------------


def stream_complete(url, body, who, timeout=60):
    """POST a streamed `body` (stream: true) to `url` (…/completion). Returns {"t", "dt", "ttft" (seconds to the
    first token's event), "tokens" (the answer's text), "probs" (top-5 per token, as complete() gives them),
    and from the last event "prompt_n", "prompt_ms", "cache_n", "predicted_n" (its timings), "tokens_cached",
    "tokens_evaluated"}, or with "error" (and "status") when the request failed."""
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
    t = time.time()
    ttft, text, probs, final = None, [], [], None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    raise RuntimeError(f"error event: {json.dumps(ev['error'])[:300]}")
                if ev.get("stop"):
                    final = ev
                    break
                if ttft is None:
                    ttft = time.time() - t
                text.append(ev.get("content") or "")
                for tok in ev.get("completion_probabilities", []) or []:
                    probs.append([(c.get("id"), round(c.get("logprob", c.get("prob", 0)), 4))
                                  for c in tok.get("top_logprobs", tok.get("probs", []))])
    except Exception as e:  # an error answer, a dead server: recorded, and the checks fail
        detail = str(e)
        if isinstance(e, urllib.error.HTTPError):
            try:
                detail += ": " + e.read().decode(errors="replace")[:300]
            except Exception:
                pass
        log("request to", who, "failed:", detail)
        return {"t": t, "dt": time.time() - t, "ttft": None, "tokens": None, "probs": None, "error": detail,
                "status": e.code if isinstance(e, urllib.error.HTTPError) else None}
    dt = time.time() - t
    if final is None:
        log("request to", who, "failed: the stream ended before its last event")
        return {"t": t, "dt": dt, "ttft": ttft, "tokens": None, "probs": None, "status": 200,
                "error": "the stream ended before its last event"}
    tm = final.get("timings") or {}
    return {"t": t, "dt": dt, "ttft": round(ttft if ttft is not None else dt, 4), "tokens": "".join(text), "probs": probs,
            "prompt_n": tm.get("prompt_n"), "prompt_ms": None if tm.get("prompt_ms") is None else round(tm["prompt_ms"], 3),
            "cache_n": tm.get("cache_n"), "predicted_n": tm.get("predicted_n"), "tokens_cached": final.get("tokens_cached"),
            "tokens_evaluated": final.get("tokens_evaluated")}


class Router:
    """llama-server in router mode, in a process group of its own; `pids` gathers the router and every
    child it ever had (polled every 0.2 s), for the GPU sum."""

    def __init__(self, a, config, models_dir, models_max, env, log_path):
        self.url = f"http://127.0.0.1:{a.port}"
        self.timeout = a.timeout
        self.log_path = log_path
        self.lf = open(log_path, "w")
        cmd = [f"{a.llama}/bin/llama-server", "--models-dir", models_dir, "--models-max", str(models_max),
               "-ngl", "0" if a.no_gpu else "999", "-c", str(a.ctx), "-np", "1", "--port", str(a.port)]
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

    def ask_stream(self, model_id, text, who):
        return stream_complete(self.url + "/completion", prompt_body(model_id, text), who, timeout=self.timeout)

    def post(self, path, body, timeout=60):
        req = urllib.request.Request(self.url + path, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=timeout).read())

    def count_tokens(self, model_id, text):
        """The model's token count of `text` (POST /tokenize through the router; no BOS), or None."""
        try:
            return len(self.post("/tokenize", {"model": model_id, "content": text}, timeout=self.timeout)["tokens"])
        except Exception as e:
            log("tokenize on", model_id, "failed:", e)
            return None

    def model_status(self, model_id):
        """The router's word for a model (GET /models: loaded, loading, unloaded, ...), or None."""
        try:
            for m in self.get("/models").get("data", []):
                if m.get("id") == model_id:
                    st = m.get("status")
                    return st.get("value") if isinstance(st, dict) else st
        except Exception:
            pass
        return None

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


def cmdline(pid):
    """`pid`'s command line as a list, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return None


def child_pid(router, path):
    """The router's child that serves the GGUF `path` (from its command line), or None."""
    for pid in router.children():
        cl = cmdline(pid)
        if cl is not None and (path in cl or os.path.realpath(path) in cl):
            return pid
    return None


def ledger_state(tool, pid):
    """`pid`'s holder in the budgets `residency stat --json` lists: {"state" (awake/asleep), "bytes", "budget"};
    state None when no budget holds it (no GPU, no preload)."""
    j = run_json([tool, "stat", "--json"])
    found = None
    for b in j.get("shared_budgets", []) or []:
        for h in b.get("holders", []) or []:
            if pid is not None and h.get("pid") == pid:
                # The budget whose manager it is says its state (the GPU budget's; the host tier's
                # ledger, where the same process holds a slot too, does not).
                if found is None or (found["state"] is None and h.get("state") is not None):
                    found = {"state": h.get("state"), "bytes": h.get("bytes"), "budget": b.get("name")}
    if found is not None:
        return found
    out = {"state": None}
    if "error" in j:
        out["stat_error"] = j["error"]
    return out


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
        cl = cmdline(pid)
        if cl is None:
            continue
        model = next((k for k, fp in enumerate(files) if fp in cl or os.path.realpath(fp) in cl), None)
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


class HostTierSampler:
    """The host tier from outside, every 250 ms: the host budget's ledger (`residency stat --json`: the sum
    its holders reserved) and what the router's children say they keep registered (each GPU budget holder's
    registered_file_bytes, from its state file: the pieces the driver pinned)."""

    def __init__(self, tool, ledger, gpu_prefix, t0, period=0.25):
        self.tool, self.ledger, self.gpu_prefix, self.t0, self.period = tool, ledger, gpu_prefix, t0, period
        self.samples, self.budget, self._stop = [], None, threading.Event()

    def start(self):
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()
        return self

    def stop(self):
        self._stop.set()
        self._th.join(timeout=10)

    def _run(self):
        while not self._stop.is_set():
            t = time.time()
            used, reg = None, 0
            j = run_json([self.tool, "stat", "--json"])
            for b in j.get("shared_budgets", []) or []:
                if b.get("name") == self.ledger:
                    used, self.budget = b.get("used"), b.get("size")
                elif b.get("name", "").startswith(self.gpu_prefix):  # the GPU budget's holders: their state files
                    reg += sum(int(h.get("registered_file_bytes") or 0) for h in b.get("holders", []) or [])
            self.samples.append([round(t - self.t0, 3), used, reg])
            self._stop.wait(max(0.0, self.period - (time.time() - t)))

    def summary(self):
        used = [x[1] for x in self.samples if x[1] is not None]
        reg = [x[2] for x in self.samples]
        return {"ledger": self.ledger, "budget": self.budget, "samples": len(self.samples),
                "ledger_used_max": max(used) if used else None, "registered_max": max(reg) if reg else None,
                "series": self.samples[:2000]}


WAKE_RE = None


def wake_lines(lines, t0):
    """Each weights wake's timeline line (RESIDENCY_LOG=debug): its bytes, time, and tier (1: from the
    registered model file; 2: read through the staging buffers; pinned: from pinned host memory only)."""
    import re
    global WAKE_RE
    if WAKE_RE is None:
        WAKE_RE = re.compile(r"wake of ([0-9.]+) MiB weights at \S+: ([0-9.]+) ms in all;.*?\(([0-9.]+) MiB from the model "
                             r"file's registered pages, ([0-9.]+) MiB read from the file through the staging buffers, "
                             r"([0-9.]+) MiB from pinned host memory")
    out = []
    for line in lines:
        m = WAKE_RE.search(line)
        if not m:
            continue
        mib, ms, reg, staged, pinned = (float(x) for x in m.groups())
        if reg + staged < mib / 2:
            continue  # not a model's weights (a KV cache, a compute buffer)
        out.append({"mib": mib, "ms": ms, "registered_mib": reg, "staged_mib": staged, "pinned_mib": pinned,
                    "tier": 2 if staged > 0 else 1})
    return out


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
           a.plain_requests if cfg == "plain" else a.requests, "seed": a.seed, "no_gpu": a.no_gpu, "ctx": a.ctx}
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD" and not k.startswith("RESIDENCY_")}
    if cfg in PRELOADED:
        env.update(LD_PRELOAD=a.preload, RESIDENCY_KEEP_ALIVE="10m", RESIDENCY_LOG=a.log_level, RESIDENCY_LOG_TIME="1",
                   RESIDENCY_GPU_BUDGET=f"{budget_name}:{a.budget}", RESIDENCY_BUDGET_WAIT=rec["budget_wait"])
        log(cfg, "RESIDENCY_GPU_BUDGET=" + env["RESIDENCY_GPU_BUDGET"], "RESIDENCY_BUDGET_WAIT=" + rec["budget_wait"])
        if a.host_budget:
            env["RESIDENCY_HOST_BUDGET"] = f"{budget_name}-host:{a.host_budget}"
            rec["host_budget"] = env["RESIDENCY_HOST_BUDGET"]
            log(cfg, "RESIDENCY_HOST_BUDGET=" + env["RESIDENCY_HOST_BUDGET"])
    hog = router = host_sampler = None
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
        if cfg in PRELOADED and a.host_budget:
            host_sampler = HostTierSampler(a.tool, f"{budget_name}-host", budget_name + ".", t_start).start()

        def ask(m, is_switch=None):
            r = router.ask(stems[m], f"{cfg} {stems[m]}")
            sw = (m != state["prev"]) if is_switch is None else is_switch
            state["prev"] = m
            r = dict(r, model=m, switch=sw, t=rel(r["t"]), dt=round(r["dt"], 4))
            r.setdefault("status", 200)
            return r

        def ask_long(m, text, kind, rnd):
            r = router.ask_stream(stems[m], text, f"{cfg} {stems[m]} {kind} {rnd}")
            sw = m != state["prev"]
            state["prev"] = m
            r = dict(r, model=m, switch=sw, t=rel(r["t"]), dt=round(r["dt"], 4), kind=kind, round=rnd)
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
            elif pat == "prompt_cache":
                # Not measured: each round's long prompt sized on A's tokenizer, then one short request
                # that makes A current (loaded, awake) in every configuration.
                texts, sizes = [], []
                for rnd in range(a.prompt_rounds):
                    text, ntok = size_prompt(lambda x: router.count_tokens(stems[0], x), rnd, a.prompt_tokens)
                    texts.append(text)
                    sizes.append(ntok)
                lead = ask(0)
                a_pid = child_pid(router, files[0])
                setup = {"prompt_tokens_tokenize": sizes, "prompt_chars": [len(x) for x in texts], "lead_in": lead,
                         "a_pid": a_pid, "sized_s": round(time.time() - t0, 2)}
                log(cfg, pat, f"long prompts of {sizes} tokens (/tokenize, no BOS), {n} models"
                    + ("" if n >= 3 else ": fewer than 3, so A is never put away"))
                t0 = time.time()
                reqs = []
                for rnd in range(a.prompt_rounds):
                    reqs.append(ask_long(0, texts[rnd], "prefill", rnd))
                    for m in range(1, n):
                        reqs.append(dict(ask(m), kind="other", round=rnd))
                    before = {"models": router.model_status(stems[0])}
                    if cfg in PRELOADED:
                        before.update(ledger_state(a.tool, a_pid))
                    reqs.append(dict(ask_long(0, texts[rnd] + follow_up(rnd), "followup", rnd), a_before=before))
                    p, f = reqs[-n - 1], reqs[-1]
                    log(cfg, pat, f"round {rnd}: prefill prompt_n {p.get('prompt_n')} ttft {p.get('ttft')} s; A before the "
                        f"follow-up {before}; follow-up prompt_n {f.get('prompt_n')} cache_n {f.get('cache_n')} "
                        f"tokens_cached {f.get('tokens_cached')} ttft {f.get('ttft')} s")
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
            if pat == "prompt_cache":
                rec["patterns"][pat]["setup"] = setup
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
        if host_sampler is not None:
            host_sampler.stop()
            rec["host_tier"] = host_sampler.summary()
        if router is not None:
            router.close()
            rec["log_scan"], res_lines = scan_log(router.log_path)
            rec["wakes"] = wake_lines(res_lines, t_start)
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
    if rec.get("ctx", 1024) != a.ctx:
        log(cfg, "cached result", path, f"ran with -c {rec.get('ctx', 1024)}, not --ctx {a.ctx}: not reported")
        return None
    rec["from_cache"] = path
    return rec


# ---- the report ---------------------------------------------------------------------------------

def all_requests(rec):
    yield "warmup", rec.get("warmup", [])
    for pat, p in rec.get("patterns", {}).items():
        yield pat, p["requests"]


PROMPT_ROW = ("round", "kind", "model", "t", "dt", "ttft", "prompt_ms", "prompt_n", "cache_n", "tokens_cached",
              "tokens_evaluated", "switch", "status", "answer_ok", "a_before", "error")


def prompt_cache_check(a, configs, n_models):
    """The check prompt_cache: (ok, detail). Never ok without a preloaded configuration's follow-ups."""
    pcs = {cfg: c["prompt_cache"] for cfg, c in configs.items() if c.get("prompt_cache")}
    pre = [cfg for cfg in PRELOADED if cfg in pcs]
    parts, ok = [], bool(pre) and n_models >= 3
    if n_models < 3:
        parts.append(f"{n_models} models: the other models cannot put A away (3 or more needed)")
    if not pre:
        parts.append("no preloaded configuration ran prompt_cache"
                     + (f" (ran: {', '.join(pcs)})" if pcs else ""))
    for cfg in pre + [x for x in ("plain", "resident") if x in pcs]:
        pc = pcs[cfg]
        pr, fu = pc["prefill"], pc["followup"]
        line = (f"{cfg}: {pc['rounds']} rounds, {pc['errors']} failed; first prompts {pr['tokens_evaluated']} tokens "
                f"(prompt_n {pr['prompt_n']}, time to first token p50 {pr['ttft_s_p50']} s, prompt_ms p50 "
                f"{pr['prompt_ms_p50']}); follow-ups: extensions {fu['extension_tokens']} tokens, prompt_n {fu['prompt_n']}, "
                f"cache_n {fu['cache_n']}, tokens_cached {fu['tokens_cached']}, time to first token p50 {fu['ttft_s_p50']} s "
                f"{fu['ttft_s']}, prompt_ms p50 {fu['prompt_ms_p50']}")
        states = [(b or {}).get("state" if cfg in PRELOADED else "models") for b in fu["a_before"]]
        line += f"; A before each follow-up: {states}"
        if cfg in PRELOADED:
            good = pc["rounds"] > 0 and pc["errors"] == 0
            for te, pn, ext, st in zip(pr["tokens_evaluated"], fu["prompt_n"], fu["extension_tokens"], states):
                good = good and isinstance(te, int) and te >= PROMPT_MIN_TOKENS and isinstance(pn, int) \
                    and isinstance(ext, int) and pn <= ext + PROMPT_SLACK and st == "asleep"
            if not good:
                line += (f" -- not shown: needs every first prompt >= {PROMPT_MIN_TOKENS} tokens, every follow-up's "
                         f"prompt_n <= its extension + {PROMPT_SLACK}, and A asleep before it"
                         + (" (--no-gpu: nothing sleeps)" if a.no_gpu else ""))
            ok = ok and good
        elif cfg == "plain":
            away = pc["rounds"] > 0 and pc["errors"] == 0 and all(x == "unloaded" for x in states)
            if not away:
                line += " -- A was not unloaded before every follow-up, or a request failed"
        parts.append(line)
    if "plain" in pcs:
        y = pcs["plain"]["followup"]["ttft_s_p50"]
        plain_away = pcs["plain"]["rounds"] > 0 and pcs["plain"]["errors"] == 0 and all(
            (b or {}).get("models") == "unloaded" for b in pcs["plain"]["followup"]["a_before"])
        for cfg in pre:
            x = pcs[cfg]["followup"]["ttft_s_p50"]
            faster = x is not None and y is not None and x < y and plain_away
            ok = ok and faster
            parts.append(f"follow-up time to first token p50: {cfg} {x} s against the plain router's {y} s"
                         + ("" if faster else " -- not below it (or plain's A stayed loaded)"))
    else:
        parts.append("the plain router did not run prompt_cache: no comparison")
    return ok, "; ".join(parts)


def host_tier_check(a, recs, configs):
    mib = 1 << 20
    parts, ok = [], True
    plain = recs.get("plain") or {}
    plain_sw = [r["dt"] for pat, reqs in all_requests(plain) if pat != "warmup" for r in reqs if r.get("switch")] if plain else []
    for cfg in PRELOADED:
        rec = recs.get(cfg)
        if not rec or "host_tier" not in rec:
            continue
        h, wakes = rec["host_tier"], rec.get("wakes", [])
        b = h.get("budget")
        within = b is not None and (h.get("ledger_used_max") or 0) <= b and (h.get("registered_max") or 0) <= b
        t1 = sorted(w["ms"] for w in wakes if w["tier"] == 1)
        t2 = sorted(w["ms"] for w in wakes if w["tier"] == 2)
        gbs = lambda ws: round(sum(w["mib"] for w in ws) * mib / (sum(w["ms"] for w in ws) / 1e3) / 1e9, 1) if ws else None
        size_link_ms = [w["mib"] * mib / (a.link_gbs * 1e9) * 1e3 for w in wakes]
        ok = ok and within and h.get("samples", 0) > 0 and bool(t2)
        parts.append(f"{cfg}: host budget {b and round(b / mib)} MiB, ledger max {h.get('ledger_used_max') and round(h['ledger_used_max'] / mib)} "
                     f"MiB, registered max {h.get('registered_max') is not None and round(h['registered_max'] / mib)} MiB over "
                     f"{h.get('samples')} samples; wakes from tier 1 (registered file): {len(t1)}, p50 "
                     f"{quantile(t1, 0.5) if t1 else None} ms, {gbs([w for w in wakes if w['tier'] == 1])} GB/s; from tier 2 "
                     f"(staged): {len(t2)}, p50 {quantile(t2, 0.5) if t2 else None} ms, "
                     f"{gbs([w for w in wakes if w['tier'] == 2])} GB/s; size/link p50 "
                     f"{round(quantile(sorted(size_link_ms), 0.5), 1) if size_link_ms else None} ms")
    if plain_sw:
        parts.append(f"plain router (a restart per switch) switch p50 {quantile(sorted(plain_sw), 0.5)} s")
    if not parts:
        return False, "no preloaded configuration ran with --host-budget"
    return ok, "; ".join(parts)


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
                                     "host", "budget_wait", "over_samples", "ctx", "host_budget", "host_tier", "wakes")
             if k in rec}
        series = [tuple(x) for x in rec.get("series", [])]
        compared = equal = 0
        ref_long = ((ref_rec or {}).get("patterns", {}).get("prompt_cache") or {}).get("requests", [])
        for pat, reqs in all_requests(rec):
            for k, r in enumerate(reqs):
                if r.get("kind") in ("prefill", "followup"):
                    # prompt_cache's long prompts: against the resident router's same request, for the preloaded
                    # configurations only (the plain router re-prefills: another computation, not compared).
                    ref = ref_long[k] if k < len(ref_long) else None
                    if cfg not in PRELOADED or ref is None or (ref.get("kind"), ref.get("round")) != (r["kind"], r["round"]) \
                            or "error" in ref:
                        r["answer_ok"] = None
                        continue
                    ok = same_answer(answer_from_json(r), answer_from_json(ref))
                elif reference is None:
                    r["answer_ok"] = None
                    continue
                else:
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
            known = [r["answer_ok"] for r in p["requests"] if r.get("answer_ok") is not None]
            st["answers_equal"] = all(known) if known else None
            ref_p = (ref_rec or {}).get("patterns", {}).get(pat)
            st["warm_s_p50"] = round(quantile(sorted(r["dt"] for r in ref_p["requests"]), 0.5), 4) if ref_p and ref_p["requests"] \
                else a.warm_s
            c["patterns"][pat] = st
            # [model, t_s, dt_s, switch, HTTP status, answer equal to the reference]
            c["requests"][pat] = [[r["model"], r["t"], r["dt"], r["switch"], r.get("status"), r.get("answer_ok")]
                                  for r in p["requests"]]
            if pat == "prompt_cache":
                c["prompt_cache"] = dict(prompt_cache_summary(p["requests"]), setup={
                    k: v for k, v in (p.get("setup") or {}).items() if k != "lead_in"})
                c["prompt_cache_requests"] = [{k: r.get(k) for k in PROMPT_ROW} for r in p["requests"]]
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

    # The switch checks read the default mode (strict) where it ran, else going over.
    main_cfg = "strict" if "strict" in configs else "residency"
    res = configs.get(main_cfg)
    resp = (res or {}).get("patterns", {})

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
    sw_check = {"check": f"switch p50 under {main_cfg} <= 1.15 x size/link + warm p50 (size {size} B, link {a.link_gbs} "
                         f"GB/s: {link_s:.4f} s; warm p50: the resident router's, same pattern)", "ok": ok,
                "detail": "; ".join(parts) or f"the {main_cfg} configuration did not run"}
    checks.append(sw_check)
    if a.hog_gib > 0 or a.budget.strip() == "100%":  # the GPU is full: the same check under its name
        checks.append(dict(sw_check, check="switch_full_gpu", claim=sw_check["check"] + (
            f"; the GPU full: {a.hog_gib:g} GiB held outside the budget" if a.hog_gib > 0 else
            "; the GPU full: the models' sum exceeds it, budget 100 %")))

    # 2b. every switch, each server's first ones included (the first release is prepared while idle)
    parts, ok = [], res is not None and any(p in resp for p in SEQUENTIAL)
    for pat in SEQUENTIAL:
        p = (recs.get(main_cfg) or {}).get("patterns", {}).get(pat)
        st = resp.get(pat)
        if p is None or st is None:
            continue
        sw = [r for r in p["requests"] if r["switch"]]
        dts = sorted(r["dt"] for r in sw)
        if not dts or st["warm_s_p50"] is None:
            ok = False
            parts.append(f"{pat}: {len(dts)} switches, warm p50 {st['warm_s_p50']}")
            continue
        firsts, seen = [], set()
        for r in sw:
            if r["model"] not in seen:
                seen.add(r["model"])
                firsts.append(round(r["dt"], 4))
        limit = 1.3 * link_s + st["warm_s_p50"]
        p99 = quantile(dts, 0.99)
        ok = ok and p99 <= limit
        parts.append(f"{pat}: {len(dts)} switches, p99 {p99:.4f} s (max {dts[-1]:.4f} s, p50 {quantile(dts, 0.5):.4f} s) "
                     f"against {limit:.4f} s; each model's first switch {firsts} s")
    checks.append({"check": "switch_first", "ok": ok,
                   "claim": f"switch p99 under {main_cfg} over all switches, the first ones included, <= 1.3 x size/link "
                            f"+ warm p50 (size {size} B, link {a.link_gbs} GB/s)",
                   "detail": "; ".join(parts) or f"the {main_cfg} configuration did not run"})

    # 3. against the plain router
    plain = configs.get("plain")
    parts, ok = [], False
    if res is not None and plain is not None:
        common = [p for p in PLAIN_PATTERNS if p != "prompt_cache" and p in resp and p in plain["patterns"]]
        ok = bool(common)
        for pat in common:
            x, y = resp[pat]["switch_s_p50"], plain["patterns"][pat]["switch_s_p50"]
            ok = ok and x is not None and y is not None and x < y
            parts.append(f"{pat}: {x} s against the plain router's {y} s")
    checks.append({"check": f"switch p50 under {main_cfg} < the plain router's switch p50 (--models-max "
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

    # 5b. the prompt cache across a switch (only when the pattern was asked or recorded)
    if "prompt_cache" in a.patterns or any("prompt_cache" in c for c in configs.values()):
        ok, detail = prompt_cache_check(a, configs, len(stems))
        checks.append({"check": "prompt_cache", "ok": ok,
                       "claim": f"A's prompt cache survives a switch away and back: under the preload, with A asleep "
                                f"(weights and KV cache in host memory), the follow-up to a >= {PROMPT_MIN_TOKENS}-token "
                                f"prompt processes only its extension (+ {PROMPT_SLACK} tokens at most), and its time to "
                                "first token is below the plain router's (--models-max "
                                f"{a.plain_models_max}, which unloads A and re-prefills)",
                       "detail": detail})

    # 5c. the host tier (when a host budget was given)
    if a.host_budget:
        ok, detail = host_tier_check(a, recs, configs)
        checks.append({"check": "host_tier", "ok": ok,
                       "claim": "the model files the sleeping models keep registered never exceed the host budget "
                                "(its ledger and the servers' own account, sampled every 250 ms); beyond it the least "
                                "recently used model wakes from its file through the staging buffers (host tier 2), "
                                "answers equal, no out-of-memory",
                       "detail": detail})

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
           "link_gbs": a.link_gbs, "kv_compute_mib": a.kv_compute_mib, "requests": a.requests, "ctx": a.ctx,
           "prompt_tokens": a.prompt_tokens if "prompt_cache" in a.patterns else None,
           "prompt_rounds": a.prompt_rounds if "prompt_cache" in a.patterns else None,
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
    # prompt_cache's requests have another shape: a file of their own, OUT-prompt-cache.csv
    rows = [(cfg, r) for cfg, rec in recs.items() for r in (rec.get("patterns", {}).get("prompt_cache") or {}).get("requests", [])]
    if rows:
        cols = ("round", "kind", "model", "t", "dt", "ttft", "prompt_ms", "prompt_n", "cache_n", "tokens_cached",
                "tokens_evaluated")
        with open(os.path.splitext(path)[0] + "-prompt-cache.csv", "w") as f:
            f.write("config,round,kind,model,t_s,wall_s,ttft_s,prompt_ms,prompt_n,cache_n,tokens_cached,tokens_evaluated,"
                    "a_before,error\n")
            for cfg, r in rows:
                b = r.get("a_before") or {}
                away = b.get("state") or b.get("models") or ""
                f.write(",".join([cfg] + ["" if r.get(k) is None else str(r.get(k)) for k in cols]
                                 + [str(away), "1" if "error" in r else ""]) + "\n")


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
        if a.hardlinks:  # one file, N names: the disk holds one model, the router sees N
            first = make_model(a.tool, f"{models_dir}/model-0.gguf", a.size, 100)
            files = [first]
            for i in range(1, a.models):
                name = f"{models_dir}/model-{i}.gguf"
                if not os.path.exists(name):
                    os.link(first, name)
                files.append(name)
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
