#!/usr/bin/env bash
# `make demo`: the main job on the built-in sample, end to end on CPU.
set -euo pipefail
OUT=${1:-demo_out}
rm -rf "$OUT"
step() { printf '\n=== %s\n' "$*"; }

step "1/5 synthesise a small Infinity-MM-layout dataset (with a few broken records)"
mmdata synth --dataset infinity-mm --output "$OUT/raw" --num-samples 400 --seed 0 --broken-fraction 0.03

step "2/5 Ray job: validate, globally shuffle, write energon-ready shards"
mmdata preprocess --dataset infinity-mm --input "$OUT/raw" --output "$OUT/shards" --seed 0 --samples-per-shard 100 --num-cpus 2

step "3/5 a tiny offline Qwen2-style tokenizer (real recipes point at a real HF tokenizer dir)"
mmdata tiny-tokenizer --output "$OUT/tokenizer"

step "4/5 look inside the dataset"
mmdata inspect "$OUT/shards" --tokenizer "$OUT/tokenizer"

step "5/5 train the tiny LLaVA-OneVision recipe on CPU (megatron-core, gloo)"
mmtrain llava-ov recipes/llava-ov-tiny.yaml run_dir="$OUT/run" "data.paths=[$OUT/shards]" tokenizer.path="$OUT/tokenizer"
mmtrain worst-samples "$OUT/run" --top 3

printf '\nDone. Shards: %s/shards  metrics: %s/run/metrics.jsonl  checkpoints: %s/run/checkpoints\n' "$OUT" "$OUT" "$OUT"
