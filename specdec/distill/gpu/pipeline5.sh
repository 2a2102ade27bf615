#!/bin/bash
# Lease 5 (docs/DISTILLATION.md, "Recipe v3"): continued training of the shipped draft on data of recipe
# v3 (more and Spec-Bench-shaped qa, stem, writing and math starters), generated during the lease. The
# draft's weights arrive in a later call than the target's GGUF (both do not fit one call's 64 MiB), so
# the trainer waits for $INIT; the shipped draft is scored as served first, beside the generator, so that
# the result has a baseline measured on the same machine.
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
GEN_S=${GEN_S:-960}
TRAIN_S=${TRAIN_S:-780}
DEV=${DEV:-cuda}
DRAFT=${DRAFT:-h256-l3-i768-kv2}
INIT=${INIT:-$W/init}
RUN=${RUN:-run5}
GEN_ARGS=${GEN_ARGS:---first-chunk 300 --chunks 400 --prompts-per-chunk 4096 --passage-fraction 0.6 --summary-passages 3}
TRAIN_ARGS=${TRAIN_ARGS:---lr 7e-4 --warmup-steps 50 --batch-tokens 32768 --max-len 1280 --eval-every 300 --save-every 500 --log-every 20}
SERVED="--head-vocab 4096 --copy-below 0.5"  # the services' head and copy rule
source "$(dirname "$0")/setup.sh"  # environment, stage(), GB/GT, the exported target; cd $W
make_eval || exit 1
generate_in_background $GEN_ARGS
stage waiting for the draft to continue from
while [ ! -f $INIT/model.safetensors ]; do sleep 5; done
stage evaluate the draft to continue from
[ -f $W/eval-init.json ] || python3 -m specdec.distill evaluate --draft $INIT --eval $W/eval.npz $SERVED --json-out $W/eval-init.json --device $DEV > /dev/null || exit 1
stage train
[ -f $W/train.done ] || { python3 -m specdec.distill train --target $W/target --data $W/data --reload-data --out $W/$RUN --draft $DRAFT --init-from $INIT --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S --device $DEV $TRAIN_ARGS && touch $W/train.done; } || exit 1
stage evaluate
cp $INIT/head_vocab.json $W/$RUN/$DRAFT/head_vocab.json || exit 1
[ -f $W/eval-$DRAFT.json ] || python3 -m specdec.distill evaluate --draft $W/$RUN/$DRAFT --eval $W/eval.npz $SERVED --json-out $W/eval-$DRAFT.json --device $DEV > /dev/null || exit 1
stage done training
touch $W/TRAINED
stage waiting for the generator
wait
stage done
touch $W/DONE
