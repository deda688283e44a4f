#!/usr/bin/env bash
# `make demo`: the main job on the built-in sample. Extended as features land.
set -euo pipefail
OUT=${1:-demo_out}
rm -rf "$OUT"
mmdata synth --dataset infinity-mm --output "$OUT/raw" --num-samples 400 --seed 0 --broken-fraction 0.03
mmdata preprocess --dataset infinity-mm --input "$OUT/raw" --output "$OUT/shards" --seed 0 --samples-per-shard 100 --num-cpus 2
mmdata inspect "$OUT/shards"
