#!/bin/bash
# Lease 7 (docs/DISTILLATION.md, "Long documents"): the shipped draft (version 2) continued on fresh data
# whose summarization documents join up to 6 of the target's answers (up to about 1,900 tokens) and
# trained on records of up to 2,048 tokens instead of 1,280: on the held-out summarization prompts the
# shipped draft agrees 0.37 (full head) / 0.55 (as served) at positions past 1,280, the length it was
# trained to, against 0.67-0.77 below it, and 23% of that category's answer tokens lie there.
export RUN=${RUN:-run8} GEN_S=${GEN_S:-1080} TRAIN_S=${TRAIN_S:-600}
export GEN_ARGS=${GEN_ARGS:---first-chunk 500 --chunks 400 --prompts-per-chunk 2048 --passage-fraction 0.8 --summary-passages 6}
export TRAIN_ARGS=${TRAIN_ARGS:---lr 2e-4 --warmup-steps 50 --batch-tokens 32768 --max-len 2048 --eval-every 300 --save-every 500 --log-every 20}
exec bash "$(dirname "$0")/pipeline5.sh"
