#!/bin/bash
# The scripts of the shipped draft's GPU run (docs/DISTILLATION.md), as run from the repository root
# on a device machine; monitor.sh starts pipeline.sh (lease 1) or, with PIPE=pipelineN.sh, a later lease's.
# monitor.sh SECONDS MODE: (re)start the pipeline if needed, watch it, then copy results to $OUT.
# MODE: logs | data | final (RUN: the run directory; NAMES: the drafts to bring back; FLOAT8=1: their
# float8 copies, written by pipeline4.sh, instead of the run's bf16 checkpoints)
W=${W:-/tmp/w}
DUR=$1; MODE=${2:-logs}
end=$((SECONDS + DUR))
running() { [ -f $W/pipeline.pid ] && kill -0 $(cat $W/pipeline.pid) 2>/dev/null; }
if ! running && [ ! -f $W/DONE ]; then
  echo "starting pipeline"; rm -rf $W/code; mkdir -p $W/code; cp -r specdec $W/code/; [ -f $W/dev.jsonl ] || cp .gpu/dev.jsonl $W/  # the Spec-Bench dev prompts, copied into git-ignored .gpu/ for evaluation only
  setsid nohup bash specdec/distill/gpu/${PIPE:-pipeline.sh} >> $W/pipeline.log 2>&1 < /dev/null &
  echo $! > $W/pipeline.pid
fi
while [ $SECONDS -lt $end ] && [ ! -f $W/DONE ]; do
  if ! running; then echo "PIPELINE STOPPED"; break; fi
  sleep 15
done
echo "--- $(date +%T) status"; grep '^===' $W/pipeline.log | tail -3
tail -c 1500 $W/pipeline.log | tr '\r' '\n' | grep -v '^\s*$' | tail -8
[ -f $W/data/generate_log.jsonl ] && { wc -l < $W/data/generate_log.jsonl; tail -1 $W/data/generate_log.jsonl; }
[ -f $W/gen.log ] && tail -c 300 $W/gen.log | tr "\r" "\n" | tail -2
[ -f $W/${RUN:-run}/train_log.jsonl ] && python3 - "$W/${RUN:-run}" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/train_log.jsonl")]
for r in rows:
    if "eval" in r:
        print("eval@", r["step"], r["tokens"], {n: (e.get("eval", {}).get("overall_macro", {}).get("agreement"), e.get("heldout_generated", {}).get("agreement")) for n, e in r["eval"].items()})
last = [r for r in rows if "lr" in r][-1:]
for r in last:
    print("last", r["step"], r["tokens"], r["elapsed_s"], {k: round(v["agree_train"], 3) for k, v in r.items() if isinstance(v, dict)})
PY
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
cd $W && tar czf $OUT/logs.tgz pipeline.log gen.log data/generate_log.jsonl ${RUN:-run}/train_log.jsonl eval-*.json 2>/dev/null
if [ "$MODE" = data ] && [ -f $W/gen.done ]; then
  size=$(du -sm $W/data | cut -f1); echo "data: ${size} MB"
  [ "$size" -lt 58 ] && tar cf - -C $W data eval.npz | split -b 15m -d - $OUT/data.tar.part-
  ls -la $OUT
fi
if [ "$MODE" = final ]; then
  cp $W/eval.npz $OUT/ 2>/dev/null
  for n in ${NAMES:-h256-l3-i768-kv2 h192-l6-i768-kv1}; do
    src=${RUN:-run}/$n; [ -n "$FLOAT8" ] && src=fp8-$n  # pipeline4.sh's float8 copies: half the bytes to bring back
    [ -d $W/$src ] && tar cf - -C $W $src $(cd $W && ls heads-$n.*.json 2>/dev/null) | split -b 15m -d - $OUT/$n.tar.part-
  done
  ls -la $OUT
fi
true
