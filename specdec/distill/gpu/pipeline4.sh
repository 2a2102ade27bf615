#!/bin/bash
# Lease 4 (run 2026-11-29; docs/DISTILLATION.md, "The run: two larger drafts"): drafts twice the
# shipped size, trained from the start, in float8 within the 32 MB limit. Recipe v2's generator writes
# new chunks while the drafts train on them (--reload-data: the trainer waits for the first; lease 1's
# shards in $W/data, if carried, are used too); every draft in $DRAFTS trains on the same batches,
# sharing one target forward; each is then evaluated and stored in float8 (specdec distill to-fp8),
# and the float8 copy evaluated again, to $W/fp8-<draft>.
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
GEN_S=${GEN_S:-900}
TRAIN_S=${TRAIN_S:-1080}
DEV=${DEV:-cuda}
# lease 1's fastest learner (0.491 against the shipped size's 0.362 after 24.5M tokens), and a cheaper one
DRAFTS=${DRAFTS:-h384-l4-i1024-kv2 h320-l4-i960-kv1}
GEN_ARGS=${GEN_ARGS:---first-chunk 200 --chunks 400 --prompts-per-chunk 4096 --passage-fraction 0.6 --summary-passages 3}
TRAIN_ARGS=${TRAIN_ARGS:---batch-tokens 32768 --max-len 1280 --eval-every 300 --save-every 500 --log-every 20 --warmup-steps 100}
source "$(dirname "$0")/setup.sh"  # environment, stage(), GB/GT, the exported target; cd $W
make_eval || exit 1
generate_in_background $GEN_ARGS
stage train
draft_flags=$(for d in $DRAFTS; do printf -- "--draft %s " "$d"; done)
[ -f $W/train.done ] || { python3 -m specdec.distill train --target $W/target --data $W/data --reload-data --out $W/run4 $draft_flags --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S --device $DEV $TRAIN_ARGS && touch $W/train.done; } || exit 1
HEAD_LIST=${HEAD_LIST:-$W/code/specdec/data/drafts/smollm2-135m-draft/head_vocab.json}  # the target's, any draft's
for d in $DRAFTS; do
  stage evaluate $d
  cp $HEAD_LIST $W/run4/$d/head_vocab.json || exit 1
  [ -f $W/eval-$d.json ] || python3 -m specdec.distill evaluate --draft $W/run4/$d --eval $W/eval.npz --head-vocab 4096 --copy-below 0.5 --json-out $W/eval-$d.json --device $DEV > /dev/null || exit 1
  stage float8 $d
  [ -f $W/fp8-$d/model.safetensors ] || python3 -m specdec.distill to-fp8 --draft $W/run4/$d --out $W/fp8-$d > $W/fp8-$d.json || exit 1
  [ -f $W/eval-fp8-$d.json ] || python3 -m specdec.distill evaluate --draft $W/fp8-$d --eval $W/eval.npz --head-vocab 4096 --copy-below 0.5 --json-out $W/eval-fp8-$d.json --device $DEV > /dev/null || exit 1
done
stage waiting for the generator
wait
stage done
touch $W/DONE
