#!/bin/bash
# The draft head's GPU run (docs/DISTILLATION.md, "A draft head on the target's hidden states"): train an
# EAGLE-style head on lease 1's shards ($W/data) with the target online, then evaluate it and the shipped
# standalone draft through the same chained metrics on the held-out dev prompts ($W/eval.npz).
# Started by head-watch.sh from the repository root.
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
TRAIN_S=${TRAIN_S:-480}
DEV=${DEV:-cuda}
HEAD_ARGS=${HEAD_ARGS:---passes 4 --batch-tokens 16384 --max-len 1280 --lr 1e-3 --warmup-steps 100 --eval-every 200 --save-every 300 --log-every 20}
source "$(dirname "$0")/setup.sh"  # environment, stage(), the exported target; cd $W
stage train-head
[ -f $W/head.done ] || { python3 -m specdec.distill train-head --target $W/target --data $W/data --out $W/headrun \
    --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S --device $DEV $HEAD_ARGS && touch $W/head.done; } || exit 1
stage evaluate-head
[ -f $W/eval-head.json ] || python3 -m specdec.distill evaluate-head --head $W/headrun/head --target $W/target \
    --eval $W/eval.npz --draft $W/code/specdec/data/drafts/smollm2-135m-draft --json-out $W/eval-head.json \
    --device $DEV --dtype float32 > /dev/null || exit 1
stage done
touch $W/DONE
