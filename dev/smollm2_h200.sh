#!/usr/bin/env bash
# The SmolLM2-135M-Instruct drafter run recorded in BENCHMARKS.md, in three stages (STAGES, default all three):
#   train   on the GPUs present: one GPU = one process (target forward on a feeder thread, drafter on the main
#           thread, same GPU); two or more = 1 target rank + 1 drafter rank (NCCL); flex_attention, bf16;
#           a checkpoint every SAVE_EVERY steps
#   curve   tau of every checkpoint on the held-out prompts (164 HumanEval + the 40 odd-numbered MT-Bench
#           questions, none used in training), CURVE_TOKENS new tokens each, fp32 target (exact losslessness
#           check), WORKERS processes sharing the GPU, greedy references computed once for all checkpoints
#   final   the last checkpoint with 128 new tokens, block verification and DDTree (budget 32) side by side
#   bash dev/smollm2_h200.sh [OUT_DIR] [SMOLLM2_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/smollm2-h200}
SMOL=${2:-$HOME/.cache/dflash/smollm2-135m-instruct}
PY=${PY:-python3}
STAGES=${STAGES:-train curve final}
WORKERS=${WORKERS:-16}
PROMPTS=${PROMPTS:-data/default/eval_prompts.jsonl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
START=$(date +%s)
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ " $STAGES " == *" train "* ]]; then
    if (( NGPU >= 2 )); then RUN=($PY -m torch.distributed.run --nproc-per-node 2 train_dflash.py); else RUN=($PY train_dflash.py); fi
    # TRAIN_SECONDS bounds the run inside one device call: SIGTERM makes it save and stop at the next step
    timeout -s TERM ${TRAIN_SECONDS:-100000} "${RUN[@]}" --TARGET="$SMOL" --OUT_DIR="$OUT" \
        --TOKEN_BUDGET=8192 --MAX_BATCH_SIZE=64 --MAX_ANCHORS=512 --BLOCK_SIZE=16 --NUM_DRAFT_LAYERS=5 \
        --EPOCHS=${EPOCHS:-30} --LR=${LR:-6e-4} --SAVE_EVERY=${SAVE_EVERY:-330} --KEEP_LAST=50 --LOG_EVERY=50 \
        --COMPILE_DRAFTER=${COMPILE_DRAFTER:-off} 2>&1 | tee -a "$OUT/train.log" | grep -v "Loading weights\|Writing model" || true
    echo "train wall: $(( $(date +%s) - START )) s"
fi
CKPTS=$(ls -d "$OUT"/checkpoints/step_*/drafter | sort)
if [[ " $STAGES " == *" curve "* ]]; then
    T=$(date +%s)
    $PY eval_dflash.py --target "$SMOL" --drafter $CKPTS --prompts "$PROMPTS" --max-new-tokens ${CURVE_TOKENS:-64} \
        --dtype float32 --workers $WORKERS --skip-long --out "$OUT/eval_curve.json" | grep "^tau=\|^== drafter\|HumanEval\|MT-Bench"
    echo "curve wall: $(( $(date +%s) - T )) s"
fi
if [[ " $STAGES " == *" final "* ]]; then
    T=$(date +%s)
    $PY eval_dflash.py --target "$SMOL" --drafter $(echo "$CKPTS" | tail -1) --prompts "$PROMPTS" --max-new-tokens 128 \
        --tree-budget 32 --dtype float32 --workers $WORKERS --skip-long --out "$OUT/eval_final.json" | tail -25
    echo "final wall: $(( $(date +%s) - T )) s"
fi
echo "total wall: $(( $(date +%s) - START )) s"
