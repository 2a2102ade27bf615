# Sourced by the scripts/gpu_*.sh benchmarks: OUT (created), PROMPTS, the wheels in WHEELS installed
# first where the GPU machine has no package index, unbuffered Python, and the GPUs' names in
# OUT/gpus.txt.
OUT=${OUT:-out}
PROMPTS=${PROMPTS:-../shared/data/specbench/dev.jsonl}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpus.txt"
