#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# The GPU sum against the budget over time, from gpu_router.py's CSV: one panel per configuration
# (strict and residency: the budget waited for or gone over; plain --models-max N; resident), the request patterns shaded apart by colour.
#   bench/plot_gpu_router.sh RESULT.csv OUT.png
# Needs gnuplot (Debian: gnuplot-nox).
set -euo pipefail
[ $# -eq 2 ] || { echo "usage: $0 RESULT.csv OUT.png" >&2; exit 2; }
csv=$1 out=$2
[ -r "$csv" ] || { echo "$0: cannot read $csv" >&2; exit 2; }
command -v gnuplot >/dev/null || { echo "$0: gnuplot is not installed (Debian: apt install gnuplot-nox)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
configs=()
for c in strict residency plain resident; do
  if awk -F, -v c="$c" 'NR > 1 && $1 == c { found = 1 } END { exit !found }' "$csv"; then configs+=("$c"); fi
done
[ ${#configs[@]} -gt 0 ] || { echo "$0: no rows of strict, residency, plain or resident in $csv" >&2; exit 2; }
# Per configuration and pattern: "t_s GiB", time from the configuration's first sample.
for c in "${configs[@]}"; do
  awk -F, -v c="$c" -v d="$tmp" 'NR > 1 && $1 == c {
      if (t0 == "") t0 = $3
      f = d "/" c "-" ($2 == "-" ? "between" : $2) ".dat"
      print $3 - t0, $4 / 1024 > f
      budget = $5 / 1024
    } END { print budget > (d "/" c ".budget") }' "$csv"
done
{
  echo "set terminal pngcairo size 1200,$((300 * ${#configs[@]})) font 'sans,11'"
  echo "set output '$out'"
  echo "set multiplot layout ${#configs[@]},1"
  echo "set ylabel 'GPU memory of the router (GiB)'"
  echo "set grid ytics lc rgb '#dddddd'"
  echo "set key outside right top"
  echo "set yrange [0:*]"
  # Okabe-Ito: colour-blind safe; the budget black and dashed.
  colors=(warmup '#999999' rr0 '#0072B2' 'rr1.6' '#E69F00' random '#009E73' burst '#D55E00' burst0 '#CC79A7' prompt_cache '#56B4E9' between '#CCCCCC')
  for i in "${!configs[@]}"; do
    c=${configs[$i]}
    budget=$(cat "$tmp/$c.budget")
    [ "$i" -eq $((${#configs[@]} - 1)) ] && echo "set xlabel 'seconds since the router started'" || echo "unset xlabel"
    echo "set title '$c'"
    plots=()
    for ((k = 0; k < ${#colors[@]}; k += 2)); do
      p=${colors[$k]} col=${colors[$((k + 1))]}
      [ -s "$tmp/$c-$p.dat" ] && plots+=("'$tmp/$c-$p.dat' using 1:2 with points pt 7 ps 0.35 lc rgb '$col' title '$p'")
    done
    { [ "$c" = residency ] || [ "$c" = strict ]; } && plots+=("$budget with lines dt 2 lw 2 lc rgb '#000000' title 'budget'")
    (IFS=,; echo "plot ${plots[*]}")
  done
  echo "unset multiplot"
} > "$tmp/plot.gp"
gnuplot "$tmp/plot.gp"
echo "wrote $out"
