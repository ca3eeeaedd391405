#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On an AMX machine with nothing installed but a compiler, cmake and Python: build a CPU-only
# llama.cpp from a source tree written by `scripts/llama-cpp --source`, make a swap file, and run
# bench/pause_flatness.py (no pressure, then a pageout of every mapping at the end of each pause)
# for a 1 GiB F16 and a 1 GiB Q8_0 model; removes the swap file and the models at the end.
#   bench/amx_engine_code.sh SRC_TARBALL BUILD_DIR OUT
# BUILD_DIR holds tools/residency/residency, src/preload/libresidency_preload.so and
# tests/preload/preload_serve_loop, built against the same llama.cpp version.
set -u
tarball=$1 B=$2 out=$3
mkdir -p "$out" /var/tmp/rs-src
tar -xzf "$tarball" -C /var/tmp/rs-src
src=$(find /var/tmp/rs-src -maxdepth 2 -name CMakeLists.txt -printf '%h\n' | head -1)
lscpu > "$out/lscpu.txt"
prefix=$(RESIDENCY_CACHE=/var/tmp/rs-cache scripts/llama-cpp --from "$src" --libs-only --jobs "$(nproc)" 2> "$out/llama-build.log") \
  || { echo "llama.cpp build failed" >> "$out/status.txt"; tail -30 "$out/llama-build.log"; exit 1; }
swap=/var/tmp/residency-swapfile
cleanup() { swapoff "$swap" 2>/dev/null; rm -f "$swap" /var/tmp/ec-*.gguf; }
trap cleanup EXIT
fallocate -l 16G "$swap" && chmod 600 "$swap" && mkswap "$swap" > /dev/null && swapon "$swap"
for t in f16 q8_0; do
  "$B/tools/residency/residency" make-model --size 1GiB --type $t /var/tmp/ec-$t.gguf > /dev/null
  for pr in none pageout; do
    flag=""; [ $pr = pageout ] && flag=--pageout
    python3 bench/pause_flatness.py --serve-loop "$B/tests/preload/preload_serve_loop" --preload "$B/src/preload/libresidency_preload.so" \
      --llama-lib "$prefix/lib" --rounds 6 --pauses 0,0.2,0.8,1.6 $flag --out "$out/$t-$pr" /var/tmp/ec-$t.gguf \
      > "$out/$t-$pr.txt" 2>&1
    echo "$t $pr rc=$?" >> "$out/status.txt"
  done
done
# Which half of the pageout the remaining time comes from (F16): file mappings only, anonymous only.
for w in file anon; do
  python3 bench/pause_flatness.py --serve-loop "$B/tests/preload/preload_serve_loop" --preload "$B/src/preload/libresidency_preload.so" \
    --llama-lib "$prefix/lib" --rounds 6 --pauses 0,0.8 --pageout --pageout-which $w --out "$out/f16-pageout-$w" \
    /var/tmp/ec-f16.gguf > "$out/f16-pageout-$w.txt" 2>&1
  echo "f16 pageout-$w rc=$?" >> "$out/status.txt"
done
free -m >> "$out/status.txt"
echo done >> "$out/status.txt"
