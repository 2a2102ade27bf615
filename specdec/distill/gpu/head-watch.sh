#!/bin/bash
# head-watch.sh SECONDS [final]: (re)start head.sh if it is not running, watch it for up to SECONDS, print
# the learning curve so far, and copy the logs (and with "final" the head, in 15 MB parts) to $OUT.
W=${W:-/tmp/w}
DUR=$1; MODE=${2:-logs}
end=$((SECONDS + DUR))
running() { [ -f $W/pipeline.pid ] && kill -0 $(cat $W/pipeline.pid) 2>/dev/null; }
if ! running && [ ! -f $W/DONE ]; then
  echo "starting head.sh"; rm -rf $W/code; mkdir -p $W/code; cp -r specdec $W/code/
  setsid nohup bash specdec/distill/gpu/head.sh >> $W/pipeline.log 2>&1 < /dev/null &
  echo $! > $W/pipeline.pid
fi
while [ $SECONDS -lt $end ] && [ ! -f $W/DONE ]; do
  if ! running; then echo "PIPELINE STOPPED"; break; fi
  sleep 10
done
echo "--- $(date +%T)"; grep '^===' $W/pipeline.log | tail -3
tail -c 1500 $W/pipeline.log | tr '\r' '\n' | grep -v '^\s*$' | tail -6
[ -f $W/headrun/train_log.jsonl ] && python3 - "$W/headrun/train_log.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for r in rows:
    if "eval" in r:
        m = r["eval"]["overall_macro"]
        print("eval@", r["step"], r["tokens"], m["first_token_agreement"], m["acceptance_k4"], m["tokens_per_step_k4"],
              r.get("heldout_generated", {}).get("acceptance_k4"))
for r in [r for r in rows if "lr" in r][-1:]:
    print("last", r["step"], r["tokens"], r["elapsed_s"], round(r["loss"], 3), {k: round(v["agree_train"], 3) for k, v in r.items() if isinstance(v, dict)})
PY
nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv,noheader
cd $W && tar czf $OUT/logs.tgz pipeline.log headrun/train_log.jsonl eval-head.json 2>/dev/null
if [ "$MODE" = final ] && [ -d $W/headrun/head ]; then
  tar cf - -C $W headrun/head | split -b 15m -d - $OUT/head.tar.part-
  ls -la $OUT
fi
true
