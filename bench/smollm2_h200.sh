#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafter run recorded in BENCHMARKS.md: 1 target GPU + 1 drafter GPU (NCCL, flex_attention,
# bf16), tau measured on held-out prompts at every checkpoint (EVAL_EVERY), then a final evaluation with DDTree.
#   bash bench/smollm2_h200.sh [OUT_DIR] [SMOLLM2_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/smollm2-h200}
SMOL=${2:-$HOME/.cache/dflash/smollm2-135m-instruct}
PY=${PY:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
START=$(date +%s)
mkdir -p "$OUT"
# TRAIN_SECONDS bounds the run inside one device call: SIGTERM makes it save and stop at the next step
timeout -s TERM ${TRAIN_SECONDS:-100000} $PY -m torch.distributed.run --nproc-per-node 2 train_dflash.py --TARGET="$SMOL" --OUT_DIR="$OUT" \
    --TOKEN_BUDGET=8192 --MAX_BATCH_SIZE=64 --MAX_ANCHORS=512 --BLOCK_SIZE=16 --GAMMA=7 --NUM_DRAFT_LAYERS=5 \
    --EPOCHS=${EPOCHS:-24} --LR=6e-4 --SAVE_EVERY=${SAVE_EVERY:-200} --KEEP_LAST=50 --LOG_EVERY=50 \
    --EVAL_EVERY=1 --EVAL_PROMPTS=data/default/eval_quick.jsonl --EVAL_LIMIT=24 --EVAL_MAX_NEW_TOKENS=128 2>&1 | tee "$OUT/train.log" | grep -v "Loading weights\|Writing model" || true
echo "train+eval wall: $(( $(date +%s) - START )) s"
LAST=$(ls -d "$OUT"/checkpoints/step_* | sort | tail -1)
timeout ${EVAL_SECONDS:-100000} $PY eval_dflash.py --target "$SMOL" --drafter "$LAST/drafter" --prompts ${FINAL_PROMPTS:-data/default/eval_prompts.jsonl} \
    --limit ${FINAL_LIMIT:-204} --max-new-tokens 128 --tree-budget 32 --skip-long --out "$OUT/eval_final.json" | tail -25
echo "total wall: $(( $(date +%s) - START )) s"
