#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# One GPU session's runs for the GPU budget, in the background on the GPU machine, after
# ../shared/gpu's setup.sh built llama.cpp (/tmp/rc/llama) and residency with its tests (/tmp/rc/rb):
#   1. the CUDA tests (ctest -L cuda)
#   2. the router, 4 mixed models (12 GiB F16 and Q8_0, 8 GiB Q8_0) under a 28 GiB budget: resident
#      (the reference) and strict (the default), round-robin and back-to-back bursts, with each
#      switch's timeline (RESIDENCY_LOG=debug): every switch, each server's first ones included
#   3. the prompt cache across a switch: 3 x 12 GiB F16, strict, plain and resident
#   4. the host tier: 4 x 12 GiB F16 under a 28 GiB GPU budget and a host budget of 25 GiB (two
#      models' files registered): resident (the answers), strict with the host budget, plain (a
#      restart per switch)
#   5. a full GPU: 4 names of one 40 GiB F16 file (hard links: the disk holds one) under a 100 %
#      budget (the four exceed the GPU); the warm time from the resident router with three of them
# Writes everything under OUT (default /tmp/res) and "done" into OUT/status at the end.
#   setsid nohup bash bench/h200_budget_run.sh [OUT] &
set -u
out=${1:-/tmp/res}
tree=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
exec >>"$out/run.log" 2>&1
rb=/tmp/rc/rb llama=/tmp/rc/llama
tool=$rb/tools/residency/residency preload=$rb/src/preload/libresidency_preload.so
# The link, measured here (pinned 4 GiB host to device, torch): the switch checks' size/link.
link=$(python3 -c "
import torch, time
h = torch.empty(4 << 30, dtype=torch.uint8).pin_memory(); d = torch.empty_like(h, device='cuda')
d.copy_(h); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(3): d.copy_(h, non_blocking=True)
torch.cuda.synchronize(); print(round(3 * (4 << 30) / (time.perf_counter() - t) / 1e9, 1))" 2>/dev/null || echo 55.2)
gpu_gib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1 / 1024)}')
echo "link $link GB/s (pinned, 4 GiB, torch); GPU $gpu_gib GiB"
common=(--llama "$llama" --preload "$preload" --tool "$tool" --link-gbs "$link")
# The models of the check of 2026-12-04: 12 GiB F16, 12 GiB Q8_0, a copy of the first, 8 GiB Q8_0.
mix=12GiB:f16:100,12GiB:q8_0,12GiB:f16:100,8GiB:q8_0
step_ctest() {
echo "== $(date +%T) ctest -L cuda"
(cd "$rb" && timeout 200 ctest -L cuda --output-on-failure --timeout 240 >"$out/ctest-cuda.log" 2>&1; echo "rc=$?" >>"$out/ctest-cuda.log")
tail -3 "$out/ctest-cuda.log"
}
step_mix() {
echo "== $(date +%T) router, 28 GiB budget, the mixed models"
timeout 360 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/grm --mix "$mix" --budget 28GiB \
  --configs resident,strict --patterns rr0,burst0 --requests ${MIX_REQUESTS:-24} --log-level debug --out "$out/router-budget.json"
cp /tmp/grm/router-strict.log "$out/router-budget-strict-full.log" 2>/dev/null
rm -rf /tmp/grm/models  # the disk holds 64 GiB
}
step_prompt() {
echo "== $(date +%T) router, the prompt cache across a switch"
# About 2 minutes, the 36 GiB of models included; strict first: if the timeout ends the step, the
# configurations done are in the JSON (and /tmp/gr/config-*.json)
timeout 200 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/gr --models 3 --size 12GiB --budget 28GiB \
  --configs strict,plain,resident --patterns prompt_cache --ctx 4096 --prompt-tokens 3000 --prompt-rounds 3 \
  --log-level debug --out "$out/router-prompt-cache.json"
cp /tmp/gr/router-strict.log "$out/router-prompt-cache-strict-full.log" 2>/dev/null
rm -rf /tmp/gr/models
}
step_host() {
echo "== $(date +%T) router, the host tier: 4 x 12 GiB, host budget 25 GiB"
timeout 330 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/ght --models 4 --size 12GiB --budget 28GiB \
  --host-budget 25GiB --configs resident,strict,plain --patterns rr0,random --requests 16 --plain-requests 6 \
  --log-level debug --out "$out/router-host-tier.json"
cp /tmp/ght/router-strict.log "$out/router-host-tier-strict-full.log" 2>/dev/null
rm -rf /tmp/ght/models
}
step_full() {
# A full GPU: four models of 29 % of the GPU each (40 GiB on an H200, 23 GiB on an H100): three fit, four do not.
big=$(( gpu_gib * 29 / 100 ))
echo "== $(date +%T) router, a full GPU: 4 x $big GiB"
timeout 200 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/g40w --models 3 --hardlinks --size ${big}GiB \
  --configs resident --patterns rr0 --requests 12 --out "$out/router-40g-warm.json"
warm=$(python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(d['configs']['resident']['patterns']['rr0']['request_s_p50'])" \
  "$out/router-40g-warm.json" 2>/dev/null || echo 0.09)
echo "warm p50 (resident, 3 x $big GiB): $warm s"
mkdir -p /tmp/g40/models && ln -f /tmp/g40w/models/model-0.gguf /tmp/g40/models/model-0.gguf 2>/dev/null
timeout 300 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/g40 --models 4 --hardlinks --size ${big}GiB \
  --budget 100% --configs strict --patterns rr0 --requests 16 --warm-s "$warm" --log-level debug \
  --out "$out/router-full-gpu-40g.json"
cp /tmp/g40/router-strict.log "$out/router-full-gpu-40g-strict-full.log" 2>/dev/null
rm -rf /tmp/g40w/models /tmp/g40/models
}
# STEPS: which, in order (the most wanted first where device time is short).
for st in ${STEPS:-ctest mix prompt host full}; do "step_$st"; done
echo "== $(date +%T) done"
echo done >"$out/status"
