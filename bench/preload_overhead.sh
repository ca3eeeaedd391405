#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Before and after a change to the core or the preload, in one run: touch(), register +
# unregister, and the decode hook's cost on a 128 MiB model through llama.cpp (issue 27, item 6).
# Each figure is a ratio against a baseline measured in the same run, the two builds interleaved
# (A B A B ...) so that the load of a shared machine falls on both; the spread over rounds is
# printed next to each median.
#
#   bench/preload_overhead.sh BEFORE_BUILD AFTER_BUILD > result.md
#
# The build directories need bench_core, residency_preload and the residency tool (configured with
# RESIDENCY_LLAMA_DIR). bench/decode_overhead.c is built here with cc against that llama.cpp.
# Environment (defaults in brackets): BEFORE_COMMIT, AFTER_COMMIT [unknown] name the builds;
# CORE_ROUNDS [3] rounds of bench_core (each --benchmark_repetitions=5); DECODE_ROUNDS [5];
# DECODES [1000] timed decodes per run after WARMUP [100] (the preload snapshots the engine memory
# up to its 64th decode); THREADS [1] decode threads (1 is steadier on a shared 2-core machine);
# MODEL_TYPE [f16]; NICE [-5] (dropped when not allowed); RAW_DIR [none]: keep the raw outputs
# (bench_core's JSON, the decode runs' lines and logs) there.
set -euo pipefail

if [[ $# -lt 2 ]]; then
  sed -n '3,18p' "$0" >&2
  exit 2
fi
before=$(cd "$1" && pwd)
after=$(cd "$2" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
CORE_ROUNDS=${CORE_ROUNDS:-3}
DECODE_ROUNDS=${DECODE_ROUNDS:-5}
DECODES=${DECODES:-1000}
WARMUP=${WARMUP:-100}
THREADS=${THREADS:-1}
MODEL_TYPE=${MODEL_TYPE:-f16}
NICE=${NICE:--5}
BEFORE_COMMIT=${BEFORE_COMMIT:-unknown}
AFTER_COMMIT=${AFTER_COMMIT:-unknown}

llama_dir=$(sed -n 's/^RESIDENCY_LLAMA_DIR:[A-Z]*=//p' "$after/CMakeCache.txt")
[[ -n "$llama_dir" ]] || { echo "no RESIDENCY_LLAMA_DIR in $after/CMakeCache.txt" >&2; exit 1; }
for b in "$before" "$after"; do
  for f in bench/bench_core src/preload/libresidency_preload.so tools/residency/residency; do
    [[ -x "$b/$f" || -f "$b/$f" ]] || { echo "missing $b/$f" >&2; exit 1; }
  done
done

work=$(mktemp -d /tmp/preload-overhead.XXXXXX)
trap 'if [[ -n "${RAW_DIR:-}" ]]; then mkdir -p "$RAW_DIR" && cp "$work"/*.json "$work"/*.txt "$work"/*.err "$RAW_DIR"/ || true; fi; rm -rf "$work"' EXIT

run=()
if nice -n "$NICE" true 2>/dev/null; then run=(nice -n "$NICE"); else NICE="0 (not allowed)"; fi
# The preload locks the model: RLIMIT_MEMLOCK or CAP_IPC_LOCK must allow 140 MiB (VmLck is printed).
ulimit -l unlimited 2>/dev/null || true

cc -O2 -Wall -Wextra -o "$work/decode_overhead" "$here/decode_overhead.c" -I"$llama_dir/include" \
  -L"$llama_dir/lib" -lllama -lggml -lggml-base -Wl,-rpath,"$llama_dir/lib"
"$after/tools/residency/residency" make-model --size 128MiB --type "$MODEL_TYPE" --threads 1 \
  "$work/model.gguf" > "$work/make-model.txt"

load_start=$(cut -d' ' -f1-3 /proc/loadavg)
started=$(date -u +%FT%TZ)

# a. bench_core, before and after alternately, CORE_ROUNDS times.
filter='BM_Touch$|BM_Touch/|BM_TouchRegion|BM_RegisterUnregister|BM_BaselineTouchBefore|BM_Call|BM_BaselineTwoTouches'
for ((r = 1; r <= CORE_ROUNDS; r++)); do
  for side in before after; do
    b=$before; [[ $side == after ]] && b=$after
    "${run[@]}" "$b/bench/bench_core" --benchmark_filter="$filter" --benchmark_repetitions=5 \
      --benchmark_report_aggregates_only=true --benchmark_out="$work/core-$side-$r.json" \
      --benchmark_out_format=json > /dev/null
  done
done

# b. The decode loop: no preload, before's, after's, keep-alive 10 min (the model stays locked:
# the hook's steady state). The order rotates each round.
configs=(none before after)
for ((r = 1; r <= DECODE_ROUNDS; r++)); do
  for ((k = 0; k < 3; k++)); do
    c=${configs[$(((r - 1 + k) % 3))]}
    env=(env -u LD_PRELOAD RESIDENCY_KEEP_ALIVE=10m)
    [[ $c == before ]] && env+=(LD_PRELOAD="$before/src/preload/libresidency_preload.so")
    [[ $c == after ]] && env+=(LD_PRELOAD="$after/src/preload/libresidency_preload.so")
    line=$("${env[@]}" "${run[@]}" "$work/decode_overhead" "$work/model.gguf" "$WARMUP" "$DECODES" "$THREADS" \
      2> "$work/decode-$c-$r.err")
    echo "$r $c $line" >> "$work/decode.txt"
  done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
flags=$(grep -m1 '^flags' /proc/cpuinfo)
of_note=()
for f in avx2 avx512f avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8; do
  [[ " $flags " == *" $f "* ]] && of_note+=("$f")
done

cat <<EOF
# Engine session restructuring: overhead before and after

- Started $started, \`bench/preload_overhead.sh\`; load average at start $load_start, at end $load_end.
- CPU: $cpu, $(nproc) cores; flags of note: ${of_note[*]:-none}$([[ " $flags " == *" amx_tile "* ]] || echo ", no AMX")$([[ " $flags " == *" avx512f "* ]] || echo ", no AVX-512"). Kernel $(uname -r).
- Before: $BEFORE_COMMIT ($before). After: $AFTER_COMMIT ($after). llama.cpp: $llama_dir.
- Model: $(cat "$work/make-model.txt")
- nice $NICE; bench_core: $CORE_ROUNDS rounds of before then after, each --benchmark_repetitions=5
  (medians of 5); decode: $DECODE_ROUNDS rounds of none/before/after (order rotating), $WARMUP untimed
  then $DECODES timed decodes per run, $THREADS thread(s), RESIDENCY_KEEP_ALIVE=10m.

EOF

python3 - "$work" "$CORE_ROUNDS" "$DECODE_ROUNDS" <<'PY'
import json, statistics, sys, os
work, core_rounds, decode_rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

def medians(path):
    out = {}
    for b in json.load(open(path))["benchmarks"]:
        if b.get("aggregate_name") == "median":
            out[b["run_name"]] = b["real_time"] if b["time_unit"] == "ns" else None
    return out

rounds = [(medians(f"{work}/core-before-{r}.json"), medians(f"{work}/core-after-{r}.json"))
          for r in range(1, core_rounds + 1)]
names = list(rounds[0][0].keys())
def rng(xs, fmt):
    return f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"
print("## bench_core (fake backend), ns per iteration\n")
print("| benchmark | before, median ns (range over rounds) | after | after/before, median (range) | after/before of the fastest rounds |")
print("|---|---|---|---|---|")
for n in names:
    b = [r[0][n] for r in rounds]
    a = [r[1][n] for r in rounds]
    ratio = [x / y for x, y in zip(a, b)]
    print(f"| {n} | {statistics.median(b):.2f} ({rng(b, '{:.2f}')}) | {statistics.median(a):.2f} ({rng(a, '{:.2f}')}) "
          f"| {statistics.median(ratio):.3f} ({rng(ratio, '{:.3f}')}) | {min(a) / min(b):.3f} |")
print("\nBM_BaselineTouchBefore is the control: the same code in both builds (no library call), so its ratio is the")
print(f"run's noise. threads:2 rows run two threads at once on this machine's {os.cpu_count()} cores, with whatever else runs there.\n")

runs = {}
for line in open(f"{work}/decode.txt"):
    f = line.split()
    r, c = int(f[0]), f[1]
    kv = dict(zip(f[2::2], f[3::2]))
    runs[(r, c)] = {k: float(v) for k, v in kv.items()}
def col(c, k): return [runs[(r, c)][k] for r in range(1, decode_rounds + 1)]
print("## Decode, 128 MiB model through llama.cpp, ms per decode (median of each run's decodes)\n")
print("| preload | ms per decode, median over runs (range) | /no preload, median (range) | load ms, median | VmLck MiB |")
print("|---|---|---|---|---|")
base = col("none", "decode_ms_median")
for c, label in (("none", "none"), ("before", "before's"), ("after", "after's")):
    ms = col(c, "decode_ms_median")
    ratio = [x / y for x, y in zip(ms, base)]
    lck = col(c, "vmlck_kib")
    print(f"| {label} | {statistics.median(ms):.3f} ({rng(ms, '{:.3f}')}) | {statistics.median(ratio):.3f} ({rng(ratio, '{:.3f}')}) "
          f"| {statistics.median(col(c, 'load_ms')):.1f} | {min(lck)/1024:.0f}-{max(lck)/1024:.0f} |")
ab = [x / y for x, y in zip(col("after", "decode_ms_median"), col("before", "decode_ms_median"))]
ab_mean = [x / y for x, y in zip(col("after", "decode_ms_mean"), col("before", "decode_ms_mean"))]
print(f"\nafter/before, same round: median {statistics.median(ab):.3f} (range {rng(ab, '{:.3f}')}); "
      f"on each run's mean decode instead of its median: {statistics.median(ab_mean):.3f} ({rng(ab_mean, '{:.3f}')})\n")
print("Raw runs (round, preload, harness line):\n")
print("```")
print(open(f"{work}/decode.txt").read().rstrip())
print("```")
errs = [f for f in sorted(os.listdir(work)) if f.endswith(".err") and os.path.getsize(f"{work}/{f}") > 0]
if errs:
    print("\nstderr of the decode runs:\n\n```")
    for f in errs: print(f, open(f"{work}/{f}").read().rstrip())
    print("```")
PY
