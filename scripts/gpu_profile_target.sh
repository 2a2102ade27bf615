#!/bin/bash
# Profile the target service with py-spy while the benchmark's pools run 8 sessions on one GPU
# (docs/BENCHMARKS.md, "Round 37"): an 8B-shape target and a 1B-shape hosted replay draft on cuda:0,
# random weights, replay acceptance 0.8; plain decoding, the draft service and the draft inside the
# target. py-spy samples the target's process in 3 s windows, each logged with its start on the
# monotonic clock that the report's request times use, so scripts/profile_phases.py can give each
# window to the pool that was running.
#
#   PY_SPY=path/to/py-spy OUT=out PROMPTS=dev.jsonl bash scripts/gpu_profile_target.sh
#   python scripts/profile_phases.py out/profile plain specdec-replay-target-0.8
#
# METHODS, K_POLICY, LEVELS, LOAD_PROMPTS, ROUNDS as in gpu_open_loop.sh; RATE: samples a second.
# WHEELS: a folder of wheels to install first. Writes OUT/profile.json, .log and profile-windows.tgz.
set -u
source "$(dirname "$0")/gpu_env.sh"
PY_SPY=${PY_SPY:-py-spy}
WINDOWS=$OUT/profile-windows
mkdir -p "$WINDOWS"
( timeout "${LIMIT_S:-400}" python3 -m specdec.cli bench --target random:llama3-8b --draft random:llama3.2-1b \
  --dtype bfloat16 --device cuda:0 --draft-device cuda:0 --threads 4 \
  --methods "${METHODS:-plain,specdec-replay-target}" --replay-alpha 0.8 --k-policy "${K_POLICY:-server}" \
  --ignore-eos --max-context 4096 --prompts "$PROMPTS" --per-category 1 --limit 4 --max-new-tokens 128 \
  --concurrency "${LEVELS:-8}" --concurrency-prompts "${LOAD_PROMPTS:-64}" --concurrency-rounds "${ROUNDS:-2}" \
  --timing-repeats 1 --coordinator-arg=--pipelining=auto --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
  echo "bench rc $?" >> "$OUT/profile.log" ) &
BENCH=$!
PID=""
for _ in $(seq 1 300); do  # the target service of a replay run (specdec.bench.replay_target)
  PID=$(pgrep -f "specdec.bench.replay_target" | head -1)
  [ -n "$PID" ] && break
  sleep 1
done
i=0
while [ -n "$PID" ] && kill -0 "$BENCH" 2>/dev/null && kill -0 "$PID" 2>/dev/null; do
  start=$(python3 -c 'import time; print(time.perf_counter())')
  "$PY_SPY" record --pid "$PID" --rate "${RATE:-400}" --duration 3 --format raw --threads --nonblocking \
    --output "$WINDOWS/w$i.txt" > /dev/null 2>> "$WINDOWS/py-spy.err"
  echo "$i $start" >> "$WINDOWS/windows.txt"
  i=$((i + 1))
done
wait "$BENCH"
grep -v "req/s" "$OUT/profile.log" | tail -12
tar czf "$OUT/profile-windows.tgz" -C "$OUT" profile-windows && rm -rf "$WINDOWS"
