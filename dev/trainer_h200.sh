#!/usr/bin/env bash
# train_dflash.py itself at the benchmark shape of BENCHMARKS.md (random Qwen3-8B, 4 x 3072 tokens, 512
# anchors, B=16, 5 layers, taps 1,9,17,25,33) on the GPUs present (1: one process; N: 1 target + N-1 drafters, or
# TARGET_RANKS), once eager and once with COMPILE_TARGET + COMPILE_DRAFTER=layers. Read the rates off the status
# lines and OUT_ROOT/{off,layers}/metrics.jsonl. Note: the final checkpoint of an 8B-shaped drafter is ~13 GB.
#   bash dev/trainer_h200.sh [ASSETS_DIR] [OUT_ROOT]
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${1:-runs/bench_assets}
OUT=${2:-runs/bench_trainer}
PY=${PY:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
NGPU=$(nvidia-smi -L | wc -l)
[[ -f "$ASSETS/target/config.json" ]] || $PY -m bench.bench_dflash --write-assets "$ASSETS" --shape qwen3-8b
if (( NGPU >= 2 )); then RUN=($PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" train_dflash.py)
else RUN=($PY train_dflash.py); fi
for m in ${MODES:-off layers}; do   # MODES: which of the two runs, in this order
    if [[ $m == off ]]; then set -- off False; else set -- layers True; fi
    rm -rf "$OUT/$1"
    "${RUN[@]}" --TARGET="$ASSETS/target" --DATA="$ASSETS/data" --MASK_TOKEN_ID=151669 --TARGET_LAYER_IDS=1,9,17,25,33 \
        --NUM_DRAFT_LAYERS=5 --BLOCK_SIZE=16 --MAX_ANCHORS=512 --TOKEN_BUDGET=12288 --MAX_BATCH_SIZE=4 \
        --TARGET_RANKS=${TARGET_RANKS:-1} --MAX_STEPS=${STEPS:-60} --LOG_EVERY=10 --SAVE_EVERY=1000000 --KEEP_LAST=1 \
        --COMPILE_DRAFTER="$1" --COMPILE_TARGET="$2" --OUT_DIR="$OUT/$1" 2>&1 | grep -v "Loading weights"
done
