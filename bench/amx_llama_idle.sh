#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# On the AMX machine: swap on, residency llama-idle on 1 GiB F16 and Q8_0 models, swap off.
set -u
B=$1 P=$2 R=$3
swap=/var/tmp/residency-swapfile
fallocate -l 8G $swap && chmod 600 $swap && mkswap $swap >/dev/null && swapon $swap
swapon --show > $R/swap.txt
for t in f16 q8_0; do
  $B/tools/residency/residency make-model --size 1GiB --type $t /var/tmp/idle-$t.gguf > /dev/null
  $B/tools/residency/residency llama-idle /var/tmp/idle-$t.gguf --llama-dir $P --preload $B/src/preload/libresidency_preload.so \
    --configs mmap,mlock,keep-alive,0,pressure-aware --keep-alive 2s --pressure pageout --out $R/idle-$t --no-plot \
    > $R/idle-$t.txt 2> $R/idle-$t.err
  echo "$t rc=$?" >> $R/status.txt
done
swapoff $swap; rm -f $swap
echo done >> $R/status.txt
