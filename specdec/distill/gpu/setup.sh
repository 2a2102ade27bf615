# Sourced by pipeline2.sh and pipeline3.sh (from the repository root, with W and GGUF set): the
# environment, the stage marker, GPU-sized generation batches (GB rows, GT tokens) and the target
# exported from its GGUF to $W/target; leaves the shell in $W.
export PYTHONPATH=/tmp/site:$W/code PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
cd $W || exit 1
stage() { echo "=== $(date +%T) $*"; }
mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ "${mem:-0}" -gt 100000 ]; then GB=4096; GT=1310720; else GB=1536; GT=655360; fi
stage export
[ -f $W/target/model.safetensors ] || python3 -c "from specdec.distill.target import export_hf; export_hf('$GGUF', '$W/target')" || exit 1
