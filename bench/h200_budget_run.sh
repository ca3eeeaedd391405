#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# One GPU session's runs for the GPU budget, in the background on the GPU machine, after
# ../shared/gpu's setup.sh built llama.cpp (/tmp/rc/llama) and residency with its tests (/tmp/rc/rb):
#   1. the CUDA tests (ctest -L cuda)
#   2. the router, 4 mixed models (12 GiB F16 and Q8_0, 8 GiB Q8_0) under a 28 GiB budget: resident (the reference), residency (going
#      over, the opt-in) and strict (RESIDENCY_BUDGET_WAIT=30s), round-robin and back-to-back
#      bursts, with each switch's timeline (RESIDENCY_LOG=debug)
#   3. the prompt cache across a switch: the router with 3 x 12 GiB F16 (made in /tmp/gr, which step 4
#      reuses), -c 4096 (a 12 GiB F16 model's KV cache: 560 MiB at 4096 tokens), a 28 GiB budget: strict,
#      plain (--models-max 2) and resident, the prompt_cache pattern (3 rounds of a 3000-token prompt, a
#      switch away and back, a follow-up that extends it)
#   4. the router with 4 x 12 GiB F16 on a full GPU (PyTorch holds 108 GiB outside the budget,
#      100 % budget): resident and residency, round-robin, with the timeline
#   5. scripts/gpu-check --quick
# Writes everything under OUT (default /tmp/res) and "done" into OUT/status at the end.
#   setsid nohup bash bench/h200_budget_run.sh [OUT] &
set -u
out=${1:-/tmp/res}
tree=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
exec >>"$out/run.log" 2>&1
rb=/tmp/rc/rb llama=/tmp/rc/llama
tool=$rb/tools/residency/residency preload=$rb/src/preload/libresidency_preload.so
common=(--llama "$llama" --preload "$preload" --tool "$tool")
# The models of the check of 2026-12-04: 12 GiB F16, 12 GiB Q8_0, a copy of the first, 8 GiB Q8_0.
mix=12GiB:f16:100,12GiB:q8_0,12GiB:f16:100,8GiB:q8_0
echo "== $(date +%T) ctest -L cuda"
(cd "$rb" && timeout 300 ctest -L cuda --output-on-failure --timeout 240 >"$out/ctest-cuda.log" 2>&1; echo "rc=$?" >>"$out/ctest-cuda.log")
tail -3 "$out/ctest-cuda.log"
echo "== $(date +%T) router, 28 GiB budget, the mixed models"
timeout 420 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/grm --mix "$mix" --budget 28GiB \
  --configs resident,residency,strict --patterns rr0,burst0 --requests 32 --log-level debug --out "$out/router-budget.json"
cp /tmp/grm/router-residency.log "$out/router-budget-residency-full.log" 2>/dev/null
cp /tmp/grm/router-strict.log "$out/router-budget-strict-full.log" 2>/dev/null
rm -rf /tmp/grm/models  # the disk holds 64 GiB
echo "== $(date +%T) router, the prompt cache across a switch"
# About 2 minutes, the 36 GiB of models included (step 4 reuses them); strict first: if the timeout
# ends the step, the configurations done are in the JSON (and /tmp/gr/config-*.json)
timeout 200 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/gr --models 3 --size 12GiB --budget 28GiB \
  --configs strict,plain,resident --patterns prompt_cache --ctx 4096 --prompt-tokens 3000 --prompt-rounds 3 \
  --log-level debug --out "$out/router-prompt-cache.json"
cp /tmp/gr/router-strict.log "$out/router-prompt-cache-strict-full.log" 2>/dev/null
echo "== $(date +%T) router, full GPU"
timeout 360 python3 "$tree/bench/gpu_router.py" "${common[@]}" --dir /tmp/gr --models 4 --size 12GiB --budget 100% \
  --hog-gib 108 --configs resident,residency --patterns rr0 --requests 24 --log-level debug --out "$out/router-full-gpu.json"
cp /tmp/gr/router-residency.log "$out/router-full-gpu-residency-full.log" 2>/dev/null
echo "== $(date +%T) gpu-check --quick"
timeout 300 "$tree/scripts/gpu-check" "$out/gpu-check" --prebuilt "$rb" --quick >/dev/null 2>&1
echo "== $(date +%T) done"
echo done >"$out/status"
