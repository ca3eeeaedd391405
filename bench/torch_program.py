#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""A PyTorch program under libresidency_cuda.so (docs/design.md, "Any CUDA program").

A decoder built with torch.nn (embedding, N blocks of attention-free MLPs with residuals, a head)
generates tokens greedily. The program is unmodified but for the measurements: it asks the preload
(through ctypes, when it is loaded) to sleep, and checks that the tokens after each sleep are the
same as before, bit for bit, eagerly and through a CUDA graph captured before the sleep. It reports
the GPU memory held asleep (torch.cuda.mem_get_info and NVML's per-process figure when nvidia-smi
is there), the first generation's time after a sleep against the bytes over the link, and, as the
baselines, moving the same model with PyTorch's own .to("cpu") / .to("cuda").

  LD_PRELOAD=build/src/cudapreload/libresidency_cuda.so RESIDENCY_KEEP_ALIVE=forever \
    python3 bench/torch_program.py --gib 8 --json out.json

Without the preload it runs the baselines only (and says so).
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

import torch


def preload():
    """The preload's calls, when it is loaded into this process; else None."""
    try:
        lib = ctypes.CDLL(None)
        lib.residency_cuda_sleep.restype = ctypes.c_int
        lib.residency_cuda_wake.restype = ctypes.c_int
        lib.residency_cuda_managed_bytes.restype = ctypes.c_ulonglong
        lib.residency_cuda_region_push.argtypes = [ctypes.c_char_p]
        lib.residency_cuda_tag.restype = ctypes.c_longlong
        lib.residency_cuda_tag.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        return lib
    except (OSError, AttributeError):
        return None


class Block(torch.nn.Module):
    def __init__(self, d, f):
        super().__init__()
        self.up = torch.nn.Linear(d, f, bias=False)
        self.down = torch.nn.Linear(f, d, bias=False)
        self.norm = torch.nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Decoder(torch.nn.Module):
    def __init__(self, vocab, d, f, layers):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList([Block(d, f) for _ in range(layers)])
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(gib, dtype, seed):
    d, f, vocab = 4096, 16384, 32000
    per_layer = 2 * d * f * 2  # bytes at 2 bytes a parameter
    layers = max(1, int(gib * (1 << 30) / per_layer))
    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = Decoder(vocab, d, f, layers).to(dtype)
    m.eval()
    return m


@torch.no_grad()
def generate(model, prompt, steps):
    tokens = prompt.clone()
    out = []
    for _ in range(steps):
        logits = model(tokens)[:, -1, :]
        nxt = logits.argmax(dim=-1, keepdim=True)
        out.append(int(nxt.item()))
        tokens = nxt  # attention-free: the last token is the state
    return out


def mem_used_mib():
    free, total = torch.cuda.mem_get_info()
    return (total - free) / (1 << 20)


def nvml_process_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        for line in out.splitlines():
            pid, used = [x.strip() for x in line.split(",")]
            if int(pid) == os.getpid():
                return float(used)
    except Exception:
        pass
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=8.0, help="weights, GiB")
    ap.add_argument("--steps", type=int, default=16, help="tokens per generation")
    ap.add_argument("--cycles", type=int, default=3, help="sleeps and wakes")
    ap.add_argument("--tag-weights", action="store_true", help="load the weights inside a 'weights' region")
    ap.add_argument("--graph", action="store_true", help="also replay a CUDA graph captured before the sleeps")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    lib = preload()
    dev = torch.cuda.get_device_name(0)
    link = None
    res = {"device": dev, "torch": torch.__version__, "gib": args.gib, "preload": lib is not None,
           "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default"), "tag_weights": args.tag_weights}

    if lib is not None and args.tag_weights:
        lib.residency_cuda_region_push(b"weights")
    t0 = time.perf_counter()
    model = build(args.gib, torch.float16, 1)
    torch.cuda.synchronize()
    if lib is not None and args.tag_weights:
        lib.residency_cuda_region_pop()
    res["load_s"] = time.perf_counter() - t0
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    res["weight_bytes"] = weight_bytes
    prompt = torch.tensor([[1, 2, 3, 4]], device="cuda")
    ref = generate(model, prompt, args.steps)
    res["tokens"] = ref
    res["awake_mib"] = mem_used_mib()
    res["awake_nvml_mib"] = nvml_process_mib()
    t0 = time.perf_counter()
    generate(model, prompt, args.steps)
    torch.cuda.synchronize()
    res["generate_awake_s"] = time.perf_counter() - t0

    graph = None
    if args.graph:
        static_in = torch.tensor([[7]], device="cuda")
        with torch.no_grad():
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    model(static_in)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = model(static_in)
        graph.replay()
        torch.cuda.synchronize()
        graph_ref = static_out.clone()

    if lib is not None:
        res["managed_bytes"] = int(lib.residency_cuda_managed_bytes())
        cycles = []
        for _ in range(args.cycles):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            lib.residency_cuda_sleep()
            sleep_s = time.perf_counter() - t0
            asleep_mib = mem_used_mib()
            asleep_nvml = nvml_process_mib()
            t0 = time.perf_counter()
            got = generate(model, prompt, 1)  # the first token wakes everything
            first_s = time.perf_counter() - t0
            got = generate(model, prompt, args.steps)
            c = {"sleep_s": sleep_s, "asleep_mib": asleep_mib, "asleep_nvml_mib": asleep_nvml,
                 "first_token_after_wake_s": first_s, "tokens_equal": got == ref}
            if graph is not None:
                lib.residency_cuda_sleep()
                graph.replay()
                torch.cuda.synchronize()
                c["graph_equal"] = bool(torch.equal(static_out, graph_ref))
            cycles.append(c)
        res["cycles"] = cycles

    # Baselines: PyTorch's own moves of the same model.
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.to("cpu")
    torch.cuda.synchronize()
    res["torch_to_cpu_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.to("cuda")
    torch.cuda.synchronize()
    res["torch_to_cuda_s"] = time.perf_counter() - t0
    res["torch_tokens_equal"] = generate(model, prompt, args.steps) == ref

    checks = {}
    if lib is not None and res.get("cycles"):
        checks["tokens_equal"] = all(c["tokens_equal"] for c in res["cycles"])
        if graph is not None:
            checks["graph_equal"] = all(c.get("graph_equal") for c in res["cycles"])
        checks["asleep_gives_back"] = all(c["asleep_mib"] < res["awake_mib"] - 0.8 * weight_bytes / (1 << 20)
                                          for c in res["cycles"])
    res["checks"] = checks
    text = json.dumps(res, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    if lib is None:
        print("torch_program: libresidency_cuda.so is not loaded: baselines only", file=sys.stderr)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
