#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The engine's working memory held with the model (src/preload/engine_memory.hpp), on a machine
# with a swap file made for the run: bench/pause_flatness.py for a 1 GiB F16 and a 1 GiB Q8_0
# model, without pressure and with a pageout of every mapping at the end of each pause; then an
# unmodified llama-server under the preload, asked once: what the engine memory holds there (its
# log line, VmLck, the locked anonymous memory). The swap file and the models are removed at the end.
#   bench/amx_engine_memory.sh BUILD_DIR LLAMA_PREFIX OUT
# BUILD_DIR holds tools/residency/residency, src/preload/libresidency_preload.so and
# tests/preload/preload_serve_loop; LLAMA_PREFIX is a scripts/llama-cpp install (bin/llama-server).
set -u
B=$1 P=$2 out=$3
mkdir -p "$out"
lscpu > "$out/lscpu.txt"
swap=/var/tmp/residency-swapfile
srv=""
cleanup() {
  [ -n "$srv" ] && kill "$srv" 2>/dev/null && wait "$srv" 2>/dev/null
  swapoff "$swap" 2>/dev/null
  rm -f "$swap" /var/tmp/em-*.gguf
}
trap cleanup EXIT
fallocate -l 16G "$swap" && chmod 600 "$swap" && mkswap "$swap" > /dev/null && swapon "$swap" \
  || { echo "no swap file" >> "$out/status.txt"; exit 1; }
for t in f16 q8_0; do
  "$B/tools/residency/residency" make-model --size 1GiB --type $t /var/tmp/em-$t.gguf > /dev/null
  for pr in none pageout; do
    flag=""; [ $pr = pageout ] && flag=--pageout
    RESIDENCY_LOG=info python3 bench/pause_flatness.py --serve-loop "$B/tests/preload/preload_serve_loop" \
      --preload "$B/src/preload/libresidency_preload.so" --llama-lib "$P/lib" --rounds 6 --pauses 0,0.2,0.8,1.6 $flag \
      --out "$out/$t-$pr" /var/tmp/em-$t.gguf > "$out/$t-$pr.txt" 2>&1
    echo "$t $pr rc=$?" >> "$out/status.txt"
  done
done

# llama-server: one request, then what is locked, by kind of mapping.
RESIDENCY_LOG=info RESIDENCY_KEEP_ALIVE=10m LD_PRELOAD="$B/src/preload/libresidency_preload.so" \
  "$P/bin/llama-server" -m /var/tmp/em-q8_0.gguf --port 8097 -c 2048 > "$out/server.log" 2>&1 &
srv=$!
python3 - "$srv" > "$out/server.txt" 2>&1 <<'EOF'
import json, sys, time, urllib.request
pid = int(sys.argv[1])
for _ in range(600):
    try:
        if urllib.request.urlopen("http://127.0.0.1:8097/health", timeout=1).status == 200:
            break
    except Exception:
        time.sleep(0.2)
req = urllib.request.Request("http://127.0.0.1:8097/completion", data=json.dumps({"prompt": "Hello", "n_predict": 8}).encode(),
                             headers={"Content-Type": "application/json"})
print("completion:", urllib.request.urlopen(req, timeout=120).status)
time.sleep(0.5)
locked, anon_rss = {}, 0
name = None
for line in open(f"/proc/{pid}/smaps"):
    f = line.split()
    if "-" in f[0] and len(f) >= 5 and ":" not in f[0]:
        path = f[5] if len(f) > 5 else ""
        name = "anonymous" if f[4] == "0" else path.rsplit("/", 1)[-1]
        anon = f[4] == "0"
        size = int(f[0].split("-")[1], 16) - int(f[0].split("-")[0], 16)
    elif f[0] == "Rss:" and anon:
        anon_rss += int(f[1])
    elif f[0] == "VmFlags:" and "lo" in f[1:]:
        locked[name] = locked.get(name, 0) + size
for l in open(f"/proc/{pid}/status"):
    if l.startswith(("VmLck", "VmRSS", "RssAnon")):
        print(l.strip())
print("anonymous Rss (kB):", anon_rss)
print("locked by mapping (kB):", {k: v // 1024 for k, v in sorted(locked.items(), key=lambda kv: -kv[1])})
EOF
kill "$srv"; wait "$srv" 2>/dev/null; srv=""
grep -E "engine (code|memory)|registered|wired" "$out/server.log" | head -20 >> "$out/server.txt"
free -m >> "$out/status.txt"
echo done >> "$out/status.txt"
