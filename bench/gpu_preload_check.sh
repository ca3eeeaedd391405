#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On a machine with an NVIDIA GPU: an unmodified llama-server (a CUDA build, all layers on the
# GPU) answers the same two requests without and with the preload; between them it idles past a
# 2 s keep-alive. Prints the answers, the server's GPU memory before and after the idle (nvidia-smi)
# and the preload's lines. Usage: bench/gpu_preload_check.sh LLAMA_PREFIX PRELOAD RESIDENCY_TOOL OUTDIR
set -u
llama=$1 preload=$2 tool=$3 out=$4
mkdir -p "$out"
model=$out/model-f16.gguf
[ -f "$model" ] || "$tool" make-model --size 2GiB --type f16 "$model" >"$out/make-model.log" 2>&1
port=18093
ask() {
  python3 - "$port" <<'PY'
import json, sys, urllib.request
req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/completion", method="POST",
    data=json.dumps({"prompt": "Once upon a time", "n_predict": 16, "temperature": 0, "cache_prompt": False}).encode(),
    headers={"Content-Type": "application/json"})
print(json.loads(urllib.request.urlopen(req, timeout=120).read())["content"].encode().hex())
PY
}
gpu_mib() { nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -v p="$1" -F', ' '$1==p {print $2}'; }
run() {  # NAME ENV...
  local name=$1; shift
  env "$@" "$llama/bin/llama-server" -m "$model" -ngl 99 -c 512 -np 1 --port $port >"$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 120); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break; sleep 0.5; done
  local a1; a1=$(ask)
  local before; before=$(gpu_mib $pid)
  sleep 4
  local after; after=$(gpu_mib $pid)
  local t0; t0=$(date +%s.%N)
  local a2; a2=$(ask)
  local t1; t1=$(date +%s.%N)
  kill $pid; wait $pid 2>/dev/null
  echo "$name: answer1=$a1 answer2=$a2 gpu_mib_after_request=$before gpu_mib_after_idle=$after second_request_s=$(python3 -c "print(round($t1 - $t0, 3))")"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run plain
run preload LD_PRELOAD="$preload" RESIDENCY_KEEP_ALIVE=2s RESIDENCY_LOG=info
grep 'residency\[' "$out/preload.log" | cut -c1-220
