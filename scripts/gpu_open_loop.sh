#!/bin/bash
# Open-loop arrivals on GPUs (docs/BENCHMARKS.md, "Round 36: open-loop load"): an 8B-shape target on
# cuda:0, a 1B-shape draft service on cuda:1 where there is one (else beside the target on cuda:0),
# random weights, replay acceptance 0.8; plain decoding, an A/A plain pool, k = 4 and the adaptive
# length, at batch 1, at LEVELS concurrent sessions (closed loop) and at RATES requests per second
# (Poisson arrivals, the same instants for every method).
#
#   RATES=1,3,6 ARRIVALS=32 LEVELS=1,8 OUT=out PROMPTS=dev.jsonl bash scripts/gpu_open_loop.sh
#
# METHODS and K_POLICY replace the methods and --k-policy, e.g. METHODS=plain,specdec-replay,
# specdec-replay-target (the draft hosted by the target's process) K_POLICY=server. PIPELINING: the
# coordinators' --pipelining (default auto; off leaves sequential cycles to the methods not named
# ...-pipelined). NAME names the outputs.
# WHEELS: a folder of wheels to install first (a machine without an index). Writes OUT/NAME.json
# and .log, and OUT/logs-NAME.tgz (the services' logs).
set -u
NAME=${NAME:-open-loop}
source "$(dirname "$0")/gpu_env.sh"
if [ -z "${DRAFT_DEVICE:-}" ]; then
  DRAFT_DEVICE=cuda:0
  [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && DRAFT_DEVICE=cuda:1
fi
timeout "${LIMIT_S:-540}" python3 -m specdec.cli bench --target random:llama3-8b --draft random:llama3.2-1b \
  --dtype bfloat16 --device cuda:0 --draft-device "$DRAFT_DEVICE" --threads 4 \
  --methods "${METHODS:-plain,plain-again,specdec-replay}" --replay-alpha 0.8 --k-policy "${K_POLICY:-fixed,server}" \
  --ignore-eos --max-context 4096 --prompts "$PROMPTS" --per-category 1 --limit 4 --max-new-tokens 128 \
  --concurrency "${LEVELS:-1,8}" --concurrency-prompts "${LOAD_PROMPTS:-48}" --concurrency-rounds "${ROUNDS:-2}" \
  --arrival-rate "${RATES:-1,3,6}" --arrival-requests "${ARRIVALS:-32}" --arrival-max-sessions 16 \
  --timing-repeats 1 --coordinator-arg=--pipelining="${PIPELINING:-auto}" --out "$OUT/$NAME.json" --log-dir /tmp/logs-$NAME \
  > "$OUT/$NAME.log" 2>&1
echo "$NAME rc $? (draft on $DRAFT_DEVICE)"
grep -v "req/s" "$OUT/$NAME.log" | tail -40
tar czf "$OUT/logs-$NAME.tgz" -C /tmp logs-$NAME 2>/dev/null
