#!/bin/bash
# Lease 2: data from lease 1 is carried; more data is generated while one draft trains (reload per epoch).
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
GEN_S=${GEN_S:-600}
TRAIN_S=${TRAIN_S:-960}
DEV=${DEV:-cuda}
DRAFT=${DRAFT:-h256-l3-i768-kv2}
GEN_EXTRA=${GEN_EXTRA:-}
TRAIN_ARGS=${TRAIN_ARGS:---batch-tokens 32768 --max-len 1280 --eval-every 300 --save-every 1000 --log-every 20 --warmup-steps 100}
source "$(dirname "$0")/setup.sh"  # environment, stage(), GB/GT, the exported target; cd $W
generate_in_background --first-chunk 3 --chunks 400 --prompts-per-chunk 8192 $GEN_EXTRA
stage train
[ -f $W/train.done ] || { python3 -m specdec.distill train --target $W/target --data $W/data --reload-data --out $W/run2 --draft $DRAFT --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S --device $DEV $TRAIN_ARGS && touch $W/train.done; } || exit 1
stage evaluate
[ -f $W/eval-$DRAFT.json ] || python3 -m specdec.distill evaluate --draft $W/run2/$DRAFT --eval $W/eval.npz --head-vocab 8192 16384 --head-data $W/data --head-out $W/heads-$DRAFT --json-out $W/eval-$DRAFT.json --device $DEV > /dev/null || exit 1
stage waiting for the generator
wait
stage done
touch $W/DONE
