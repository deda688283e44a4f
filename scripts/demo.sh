#!/usr/bin/env bash
# `make demo`: the main job on the built-in sample, end to end on CPU.
set -euo pipefail
OUT=${1:-demo_out}
rm -rf "$OUT"
step() { printf '\n=== %s\n' "$*"; }

step "1/7 synthesise a small Infinity-MM-layout dataset (with a few broken records)"
mmdata synth --dataset infinity-mm --output "$OUT/raw" --num-samples 400 --seed 0 --broken-fraction 0.03

step "2/7 Ray job: validate, globally shuffle, write energon-ready shards"
mmdata preprocess --dataset infinity-mm --input "$OUT/raw" --output "$OUT/shards" --seed 0 --samples-per-shard 100 --num-cpus 2

step "3/7 a tiny offline Qwen2-style tokenizer (real recipes point at a real HF tokenizer dir)"
mmdata tiny-tokenizer --output "$OUT/tokenizer"

step "4/7 look inside the dataset"
mmdata inspect "$OUT/shards" --tokenizer "$OUT/tokenizer"

step "5/7 train the tiny LLaVA-OneVision recipe on CPU (megatron-core, gloo)"
mmtrain train recipes/llava-ov-tiny.yaml run_dir="$OUT/run" "data.paths=[$OUT/shards]" tokenizer.path="$OUT/tokenizer"
mmtrain worst-samples "$OUT/run" --top 3

step "6/7 Emu3: a tiny random VQ image tokenizer and Emu3-layout tokenizer; the shards' images -> VQ token shards"
mmdata tiny-vq --output "$OUT/vq"
mmdata tiny-tokenizer --family emu3 --output "$OUT/emu3_tokenizer"
mmdata tokenize-images "$OUT/shards" --vision-tokenizer "$OUT/vq" --output "$OUT/tokens" --image-area 4096 --num-cpus 2 --no-progress

step "7/7 train the tiny Emu3 recipe on CPU (image understanding + caption-to-image generation)"
mmtrain train recipes/emu3-tiny.yaml run_dir="$OUT/emu3_run" "data.paths=[$OUT/tokens]" tokenizer.path="$OUT/emu3_tokenizer"

printf '\nDone. Shards: %s/shards  metrics: %s/run/metrics.jsonl  checkpoints: %s/run/checkpoints\n' "$OUT" "$OUT" "$OUT"
printf 'Emu3: token shards %s/tokens  metrics %s/emu3_run/metrics.jsonl  checkpoints %s/emu3_run/checkpoints\n' "$OUT" "$OUT" "$OUT"
