#!/bin/bash
# Lease 3: continued training of the shipped draft on data recipe v2 (docs/DISTILLATION.md, "Continued
# training"). The draft starts from the shipped checkpoint (--init-from); lease 1's three shards are carried
# in as $W/data; the v2 generator (news articles as summarization passages, documents of 1-3 answers, 60%
# passage tasks) writes new chunks from chunk 100 on while the draft trains (--reload-data).
W=${W:-/tmp/w}
GGUF=${GGUF:-/tmp/t/smol.gguf}
GEN_S=${GEN_S:-840}
TRAIN_S=${TRAIN_S:-1020}
DEV=${DEV:-cuda}
DRAFT=${DRAFT:-h256-l3-i768-kv2}
INIT=${INIT:-$W/code/specdec/data/drafts/smollm2-135m-draft}
GEN_ARGS=${GEN_ARGS:---first-chunk 100 --chunks 400 --prompts-per-chunk 4096 --passage-fraction 0.6 --summary-passages 3}
TRAIN_ARGS=${TRAIN_ARGS:---lr 1e-3 --warmup-steps 50 --batch-tokens 32768 --max-len 1280 --eval-every 300 --save-every 500 --log-every 20}
source "$(dirname "$0")/setup.sh"  # environment, stage(), GB/GT, the exported target; cd $W
make_eval || exit 1
generate_in_background $GEN_ARGS
stage train
[ -f $W/train.done ] || { python3 -m specdec.distill train --target $W/target --data $W/data --reload-data --out $W/run3 --draft $DRAFT --init-from $INIT --eval $W/eval.npz --max-steps 0 --time-budget $TRAIN_S --device $DEV $TRAIN_ARGS && touch $W/train.done; } || exit 1
stage evaluate
[ -f $W/eval-$DRAFT.json ] || python3 -m specdec.distill evaluate --draft $W/run3/$DRAFT --eval $W/eval.npz --json-out $W/eval-$DRAFT.json --device $DEV > /dev/null || exit 1
stage waiting for the generator
wait
stage done
touch $W/DONE
