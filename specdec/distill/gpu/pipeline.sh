#!/bin/bash
# Background distillation pipeline on the GPU machine. Re-entrant: each stage is skipped when done.
# Lease 1 of the shipped run (docs/DISTILLATION.md): export, reference answers, data, a size sweep.
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
GEN_S=${GEN_S:-480}
TRAIN_S=${TRAIN_S:-540}
GEN_ARGS=${GEN_ARGS:---chunks 400 --prompts-per-chunk 8192 --batch-size 4096 --max-batch-tokens 1310720}
EVAL_NEW=${EVAL_NEW:-256}
DRAFTS=${DRAFTS:---draft h256-l3-i768-kv2 --draft h192-l6-i768-kv1 --draft h128-l2-i512-kv1 --draft h384-l4-i1024-kv2}
TRAIN_ARGS=${TRAIN_ARGS:---batch-tokens 32768 --max-len 1280 --eval-every 200 --save-every 1000 --log-every 10 --warmup-steps 100}
HEADS=${HEADS:-8192 16384 24576}
export PYTHONPATH=/tmp/site:$W/code PYTHONUNBUFFERED=1
cd $W || exit 1
stage() { echo "=== $(date +%T) $*"; }
set -o pipefail
stage export
[ -f $W/target/model.safetensors ] || python3 -c "from specdec.distill.target import export_hf; export_hf('$GGUF', '$W/target')" || exit 1
stage make-eval
[ -f $W/eval.npz ] || python3 -m specdec.distill make-eval --target $W/target --prompts $W/dev.jsonl --out $W/eval.npz --max-new-tokens $EVAL_NEW --dtype float32 || exit 1
stage generate-data
[ -f $W/gen.done ] || { python3 -m specdec.distill generate-data --target $W/target --out $W/data $GEN_ARGS --time-budget $GEN_S && touch $W/gen.done; } || exit 1
stage train
[ -f $W/train.done ] || { python3 -m specdec.distill train --target $W/target --data $W/data --out $W/run $DRAFTS --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S $TRAIN_ARGS && touch $W/train.done; } || exit 1
stage evaluate
for d in $W/run/h*/; do
  n=$(basename $d)
  [ -f $W/eval-$n.json ] || python3 -m specdec.distill evaluate --draft $d --eval $W/eval.npz --head-vocab $HEADS --head-data $W/data --head-out $W/heads-$n --json-out $W/eval-$n.json > /dev/null || exit 1
done
stage done
touch $W/DONE
