# SPDX-License-Identifier: MIT
"""What the GPU benchmarks share (gpu_budget_servers.py, gpu_router.py): the PyTorch hog, the
make-model models, the nvidia-smi sampler of per-process GPU memory (every 50 ms) with the
largest excess over a budget and the time over it, the greedy completion request (n_predict 8,
top-5 log-probs) and the comparison of its answers. Imported from the scripts' own directory:
`cp bench/gpu_*.py /tmp/` copies it with them. Uses only the Python standard library.
"""
import json, os, subprocess, sys, threading, time, urllib.error, urllib.request

MiB = 1 << 20
PROMPT = "Once upon a time"


def log(*x):
    print(time.strftime("%T"), *x, flush=True)


def gpu_total_mib():
    return int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True).stdout.split()[0])


def gpu_name():
    return subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], capture_output=True,
                          text=True).stdout.strip()


def host_cpu():
    return subprocess.run("lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True, text=True).stdout.strip()


def budget_mib(budget, total_mib):
    """RESIDENCY_GPU_BUDGET's size, NGiB or N%, in MiB (a percent of total_mib)."""
    return total_mib * float(budget[:-1]) / 100 if budget.endswith("%") else float(budget[:-3]) * 1024


def start_hog(gib):
    """A PyTorch process outside any budget that holds `gib` GiB of the GPU; returns once it holds them
    (None for 0)."""
    if gib <= 0:
        return None
    hog = subprocess.Popen([sys.executable, "-c", "import sys,time,torch\n"
                            f"x=torch.empty({int(gib * 2**30)},dtype=torch.uint8,device='cuda');print('ready',flush=True);time.sleep(3600)"],
                           stdout=subprocess.PIPE, text=True)
    hog.stdout.readline()
    return hog


def make_model(tool, path, size, seed, wtype="f16"):
    """`residency make-model` (F16 unless `wtype`) unless `path` exists: model making is the slow part, never undone."""
    if not os.path.exists(path):
        t = time.time()
        subprocess.run([tool, "make-model", "--size", size, "--type", wtype, "--seed", str(seed), path],
                       check=True, stdout=subprocess.DEVNULL)
        log("made", path, f"{time.time() - t:.1f} s")
    return path


def make_models(tool, directory, n, size):
    """DIRECTORY/model-I.gguf for I < n, seed 100 + I."""
    return [make_model(tool, f"{directory}/model-{i}.gguf", size, 100 + i) for i in range(n)]


class GpuSampler:
    """`nvidia-smi --query-compute-apps` every 50 ms, from outside: `samples` is a list of
    (time.time(), {pid: MiB}), one per nvidia-smi timestamp (a process absent from a sample holds
    nothing then)."""

    def __init__(self, interval_ms=50):
        self.samples = []
        self.interval_ms = interval_ms
        self._stop = threading.Event()
        self._q = None

    def start(self):
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self):
        q = self._q = subprocess.Popen(["nvidia-smi", "--query-compute-apps=timestamp,pid,used_memory",
                                        "--format=csv,noheader,nounits", "-lms", str(self.interval_ms)],
                                       stdout=subprocess.PIPE, text=True)
        cur_ts, cur = None, {}
        for line in q.stdout:
            if self._stop.is_set():
                break
            parts = [x.strip() for x in line.split(",")]
            if len(parts) != 3:
                continue
            ts, pid, mib = parts
            if ts != cur_ts and cur_ts is not None:
                self.samples.append((time.time(), cur))
                cur = {}
            cur_ts = ts
            try:
                cur[int(pid)] = int(mib)
            except ValueError:
                pass
        q.terminate()

    def stop(self):
        self._stop.set()
        if self._q is not None and self._q.poll() is None:
            self._q.terminate()


def sums(samples, pids, t0=None, t1=None):
    """[(t, summed MiB of `pids`)] for the samples in [t0, t1] (either end open when None)."""
    return [(t, sum(v for p, v in s.items() if p in pids)) for t, s in samples
            if (t0 is None or t0 <= t) and (t1 is None or t <= t1)]


def over_budget(series, budget):
    """(largest excess in MiB, 0 if never over; seconds over): a sample over the budget counts until the next."""
    over = [x - budget for _, x in series if x > budget]
    time_over = 0.0
    for (ta, xa), (tb, _) in zip(series, series[1:]):
        if xa > budget:
            time_over += tb - ta
    return (max(over) if over else 0), time_over


def quantile(sorted_xs, f):
    """The gpu benchmarks' percentile: the element at int(f * n) of the sorted list (the last at most)."""
    return sorted_xs[min(len(sorted_xs) - 1, int(f * len(sorted_xs)))]


def request_body(model=None):
    """The greedy request: 8 tokens, top-5 log-probs; `model` names the router's model."""
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 5, "cache_prompt": False, "seed": 1}
    if model is not None:
        body["model"] = model
    return body


def complete(url, body, who, timeout=60):
    """POST `body` to `url` (…/completion). Returns {"t", "dt", "tokens", "probs"}, or with "error" (and
    "status", the HTTP status or None) when the request failed; `who` names the target in the log."""
    req = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.time()
    try:
        r = json.loads(urllib.request.urlopen(req, timeout=timeout).read())
    except Exception as e:  # an error answer, a dead server: recorded, and the answers check fails
        log("request to", who, "failed:", e)
        return {"t": t, "dt": time.time() - t, "tokens": None, "probs": None, "error": str(e),
                "status": e.code if isinstance(e, urllib.error.HTTPError) else None}
    dt = time.time() - t
    probs = [[(c.get("id"), round(c.get("logprob", c.get("prob", 0)), 4)) for c in tok.get("top_logprobs", tok.get("probs", []))]
             for tok in r.get("completion_probabilities", [])]
    return {"t": t, "dt": dt, "tokens": r.get("tokens") or r.get("content"), "probs": probs}


def same_answer(r, ref):
    """r answered, and with ref's tokens and top-5 log-probs."""
    return "error" not in r and r["tokens"] == ref["tokens"] and r["probs"] == ref["probs"]


def answer_from_json(a):
    """An answer read back from JSON: its log-probs as the tuples complete() makes."""
    return dict(a, probs=None if a.get("probs") is None else [[tuple(c) for c in tok] for tok in a["probs"]])
