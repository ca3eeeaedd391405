#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Is a pause shorter than the keep-alive free? The first token after a pause, plain llama.cpp
against the same program under libresidency_preload.so (keep-alive longer than every pause), at
the same pauses, on the same machine, in one run (issue 17 item 4: residency keep-alive should be
within 1.10x of pause 0 for pauses shorter than the keep-alive).

tests/preload/serve_loop decodes one token after each pause (with --pageout, after every mapping
of the process was paged out from outside at the end of the pause); pauses are visited in a shuffled
order, ROUNDS times each, one configuration after the other (never two at once). What a pause
costs llama.cpp itself (its threads and the CPU waking) shows in the plain column; what residency
adds is the ratio of the two columns at the same pause.

  bench/pause_flatness.py --serve-loop BIN --preload SO --llama-lib DIR MODEL [--gpu-layers N]
"""
import os, random, statistics, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_partial_offload import Loop, serve_loop_parser  # noqa: E402
from procmem import page_out, read_back, smaps  # noqa: E402


def _anonymous(line):
    """A /proc/PID/maps line of anonymous memory: no path ([heap], [stack], [anon:...] or nothing)."""
    f = line.split(maxsplit=5)
    return len(f) < 6 or not f[5].startswith("/")


# Which mappings --pageout pages out: all of them, only anonymous memory (the heap, stacks, what
# malloc mapped: with the preload, the registered buffers are locked and refused), or only file
# mappings (the program's and the libraries' code and data, the GGUF file).
PAGEOUT_WHICH = {"all": None, "anon": _anonymous, "file": lambda line: not _anonymous(line)}


def measure(args, preload, pauses):
    env = {"LD_PRELOAD": args.preload, "RESIDENCY_KEEP_ALIVE": args.keep_alive} if preload else {}
    log = os.path.join(args.out, f"pause-{'preload' if preload else 'plain'}.log")
    loop = Loop(args, [args.model, str(args.gpu_layers)], env, log)
    times = {p: [] for p in pauses}
    back = {}  # mapping name -> (Rss kB gained, swap kB read back), summed over the timed tokens
    try:
        loop.gen(4)  # warm: the first decode wires (preload) and faults pages in
        order = [p for p in pauses for _ in range(args.rounds)]
        random.Random(1).shuffle(order)
        for p in order:
            if loop.p.stdin is None:
                break
            loop.p.stdin.write("reset\n")  # same context length at every measurement
            loop.p.stdin.flush()
            loop.p.stdout.readline()
            loop.gen(2)
            time.sleep(p)
            if args.pageout:
                page_out(loop.p.pid, PAGEOUT_WHICH[args.pageout_which])  # pressure from outside at the end of the pause
            before = smaps(loop.p.pid) if args.pageout else None
            ms, _ = loop.gen(1)
            times[p].append(ms)
            if before is not None:  # what the timed token read back, by mapping
                for name, (gained, swapped_in) in read_back(before, smaps(loop.p.pid)).items():
                    g, s = back.get(name, (0, 0))
                    back[name] = (g + gained, s + swapped_in)
    finally:
        loop.close()
    return times, back


def main():
    ap = serve_loop_parser(__doc__)
    ap.add_argument("--keep-alive", default="10s")
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--pauses", default="0,0.2,0.8,1.6,3.2")
    ap.add_argument("--pageout", action="store_true",
                    help="page out every mapping of the process (file and anonymous) at the end of each pause")
    ap.add_argument("--pageout-which", choices=sorted(PAGEOUT_WHICH), default="all",
                    help="with --pageout: all mappings, only anonymous ones, or only file mappings")
    ap.add_argument("model")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    pauses = [float(x) for x in args.pauses.split(",")]
    plain, plain_back = measure(args, False, pauses)
    pre, pre_back = measure(args, True, pauses)
    med = lambda v: statistics.median(v) if v else float("nan")
    lines = [f"first token after a pause (ms, median of {args.rounds}, mean +/- sd); keep-alive {args.keep_alive}; "
             f"gpu layers {args.gpu_layers}" +
             (f"; {'every' if args.pageout_which == 'all' else args.pageout_which} mapping paged out (process_madvise "
              "MADV_PAGEOUT) at the end of each pause" if args.pageout else ""), "",
             "| pause (s) | plain llama.cpp | / pause 0 | with the preload | / pause 0 | preload / plain |",
             "|---:|---:|---:|---:|---:|---:|"]
    for p in pauses:
        a, b = plain[p], pre[p]
        lines.append(f"| {p:g} | {med(a):.2f} ({statistics.mean(a):.2f} +/- {statistics.pstdev(a):.2f}) | "
                     f"{med(a) / med(plain[pauses[0]]):.2f}x | "
                     f"{med(b):.2f} ({statistics.mean(b):.2f} +/- {statistics.pstdev(b):.2f}) | "
                     f"{med(b) / med(pre[pauses[0]]):.2f}x | {med(b) / med(a):.2f}x |")
    if args.pageout:  # what each timed token read back after the pageout (major faults), per token
        n = max(1, len(pauses) * args.rounds)
        for title, back in (("plain llama.cpp", plain_back), ("with the preload", pre_back)):
            lines += ["", f"{title}: what one timed token read back after the pageout (mean kB per token, by mapping)", "",
                      "| mapping | pages back (kB) | of which from swap (kB) |", "|---|---:|---:|"]
            lines += [f"| {name} | {g / n:.0f} | {s / n:.0f} |"
                      for name, (g, s) in sorted(back.items(), key=lambda kv: -kv[1][0])[:12]]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "pause-flatness.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
