# Sourced by pipeline2.sh and the later leases' pipelines (from the repository root, with W and GGUF set):
# the environment, the stage marker, GPU-sized generation batches (GB rows, GT tokens), the target
# exported from its GGUF to $W/target, and the stages the pipelines share; leaves the shell in $W.
export PYTHONPATH=/tmp/site:$W/code PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cd $W || exit 1
stage() { echo "=== $(date +%T) $*"; }
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${mem:-0}" -gt 100000 ]; then GB=4096; GT=1310720; else GB=1536; GT=655360; fi
stage export
[ -f $W/target/model.safetensors ] || python3 -c "from specdec.distill.target import export_hf; export_hf('$GGUF', '$W/target')" || exit 1

# The dev prompts' reference answers, made once.
make_eval() {
  stage make-eval
  [ -f $W/eval.npz ] || python3 -m specdec.distill make-eval --target $W/target --prompts $W/dev.jsonl --out $W/eval.npz \
    --max-new-tokens 256 --dtype float32
}
# generate-data with these arguments in the background until $W/gen.done (GEN_S seconds, on DEV).
generate_in_background() {
  stage generate-data in background
  [ -f $W/gen.done ] && return
  (python3 -m specdec.distill generate-data --target $W/target --out $W/data "$@" --batch-size $GB --max-batch-tokens $GT \
    --time-budget $GEN_S --device $DEV > $W/gen.log 2>&1; touch $W/gen.done) &
}
