#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# keep-alive 2 s flatness on the AMX machine: with pageout (file + anonymous) and without pressure.
set -u
B=$1 P=$2 R=$3
swap=/var/tmp/residency-swapfile
fallocate -l 8G $swap && chmod 600 $swap && mkswap $swap >/dev/null && swapon $swap
$B/tools/residency/residency make-model --size 1GiB --type f16 /var/tmp/flat-f16.gguf > /dev/null
for pr in pageout none; do
  $B/tools/residency/residency llama-idle /var/tmp/flat-f16.gguf --llama-dir $P --preload $B/src/preload/libresidency_preload.so \
    --configs keep-alive --keep-alive 2s --pressure $pr --rounds 2 --out $R/flat-$pr --no-plot > $R/flat-$pr.txt 2>&1
  echo "$pr rc=$?" >> $R/status.txt
done
swapoff $swap; rm -f $swap
echo done >> $R/status.txt
