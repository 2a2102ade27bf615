#!/bin/bash
# Lease 6 (docs/DISTILLATION.md, "Recipe v3, continued"): lease 5's pipeline with lease 5's draft as the
# one to continue from ($W/init), over lease 5's five recipe-v3 chunks (carried into $W/data, one beside
# each GGUF half and three with the weights) and fresh v3 chunks written during the lease (chunk 305 on:
# other prompts than lease 5's), at a smaller learning rate. (The lease ran these settings from a
# standalone copy of pipeline5.sh; the stages are the same.)
export RUN=${RUN:-run7} GEN_S=${GEN_S:-1000} TRAIN_S=${TRAIN_S:-1000}
export GEN_ARGS=${GEN_ARGS:---first-chunk 305 --chunks 400 --prompts-per-chunk 4096 --passage-fraction 0.6 --summary-passages 3}
export TRAIN_ARGS=${TRAIN_ARGS:---lr 5e-4 --warmup-steps 50 --batch-tokens 32768 --max-len 1280 --eval-every 300 --save-every 500 --log-every 20}
exec bash "$(dirname "$0")/pipeline5.sh"
