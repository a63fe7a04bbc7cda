#!/usr/bin/env bash
# The openers lever at equal data and steps, judged on the broad per-category set: A = the code-leaning openers
# (data/default/openers.jsonl, one turn), B = the general openers (data/default/openers_general.jsonl), NUM_B2 of its
# rows two-turn. Parts sized for 10-minute device calls on one GPU; each resumes from what the last left under $WORK.
#   PART=setup1          wheels from .whl/ into /tmp/site; the GGUF's first half (.gguf/part-aa) to $WORK
#   PART=setup2          join with .gguf/part-ab and convert (tools.smollm2)
#   PART=gen             the three sets (resumable: rerun to go on), each bounded by GEN_SECONDS
#   PART=prep            data.prepare of A and of B (B1 + B2)
#   PART=train           both drafters side by side, STEPS each, bounded by TRAIN_SECONDS (RESUME=auto goes on)
#   PART=eval            walk tau (fp32) of both at their common step on the broad set and the 204-prompt set,
#                        tools.tau_diff; then the fast decode loop on the broad set: bf16, and fp32 target + bf16 drafter
#   SMOKE=1 WORK=/tmp/r SMOL=~/.cache/dflash/smollm2-135m-instruct PART="gen prep train eval" bash dev/recipe_h200.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${PART:-"setup2 gen prep train eval"}
WORK=${WORK:-/root/r}
OUT=${OUT:-$WORK/out}
PY=${PY:-python3}
SMOL=${SMOL:-$WORK/smollm2-135m-instruct}
SMOKE=${SMOKE:-0}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK/gen" "$OUT"
if [ "$SMOKE" = 1 ]; then
    NUM_A=${NUM_A:-12}; NUM_B1=${NUM_B1:-10}; NUM_B2=${NUM_B2:-2}; SLOTS=8; NEW=16; STEPS=${STEPS:-4}; BUDGET=512
    ANCHORS=16; LAYERS=1; DEV=cpu; DT=float32; EVAL_NEW=16; LIM=(--limit 4); LOG_EVERY=1
else
    NUM_A=${NUM_A:-16000}; NUM_B1=${NUM_B1:-12800}; NUM_B2=${NUM_B2:-3200}; SLOTS=2048; NEW=384; STEPS=${STEPS:-1200}
    BUDGET=8192; ANCHORS=4096; LAYERS=5; DEV=cuda; DT=bfloat16; EVAL_NEW=128; LIM=(); LOG_EVERY=100
fi
T0=$(date +%s)
say() { echo "[recipe $(( $(date +%s) - T0 ))s] $*"; }

part_setup1() {
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    cp .gguf/part-aa "$WORK/gguf.part-aa"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
}

part_setup2() {
    [ -f "$SMOL/config.json" ] && return 0
    cat "$WORK/gguf.part-aa" .gguf/part-ab > "$WORK/smollm2.gguf"
    $PY -m tools.smollm2 --gguf "$WORK/smollm2.gguf" --out "$SMOL"
}

gen_one() {   # gen_one NAME NUM OPENERS SEED TURNS
    local f=$WORK/gen/$1.jsonl
    timeout -s TERM "${GEN_SECONDS:-100000}" $PY -m data.synthesize --model "$SMOL" --num "$2" --out "$f" --seed "$4" \
        --turns "$5" --mix data/default/train_prompts.jsonl --mix-ratio 0.02 --max-new-tokens "$NEW" --prompt-tokens 128 \
        --openers "$3" --temperature 0 --prompt-temperature 1.0 --batch-size "$SLOTS" --attention matmul \
        $( [ "$SMOKE" = 1 ] || echo --compile-sampler ) --device "$DEV" --dtype "$DT" 2>&1 | tr '\r' '\n' | grep -v "%|" | tail -6 || say "$1 stopped (rc $?): rerun to go on"
    say "$1: $(wc -l < "$f") rows"
    cp "$f.stats.json" "$OUT/gen_stats_$1.json" 2>/dev/null || true
}

part_gen() {
    gen_one A "$NUM_A" data/default/openers.jsonl 0 1
    gen_one B1 "$NUM_B1" data/default/openers_general.jsonl 0 1
    gen_one B2 "$NUM_B2" data/default/openers_general.jsonl 1 2
}

part_prep() {
    $PY -m data.prepare --tokenizer "$SMOL" --out "$WORK/prep_A" --max-len 2048 --overwrite "$WORK/gen/A.jsonl" | tail -2
    $PY -m data.prepare --tokenizer "$SMOL" --out "$WORK/prep_B" --max-len 2048 --overwrite \
        "$WORK/gen/B1.jsonl" "$WORK/gen/B2.jsonl" | tail -2
    cp "$WORK/prep_A/stats.json" "$OUT/prep_A_stats.json"; cp "$WORK/prep_B/stats.json" "$OUT/prep_B_stats.json"
}

part_train() {
    local pids=()
    for r in A B; do
        mkdir -p "$WORK/runs/$r"
        timeout -s TERM "${TRAIN_SECONDS:-100000}" $PY train_dflash.py --TARGET="$SMOL" --DATA="$WORK/prep_$r" \
            --OUT_DIR="$WORK/runs/$r" --DEVICE="$DEV" --TOKEN_BUDGET="$BUDGET" --MAX_BATCH_SIZE=64 \
            --MAX_ANCHORS="$ANCHORS" --BLOCK_SIZE=16 --NUM_DRAFT_LAYERS="$LAYERS" --MAX_STEPS="$STEPS" --LR=6e-4 \
            --SAVE_EVERY=$(( STEPS / 4 > 0 ? STEPS / 4 : 1 )) --KEEP_LAST=5 --LOG_EVERY="$LOG_EVERY" \
            >> "$WORK/runs/$r/train.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    for r in A B; do echo "== $r"; grep -a "step \|done\|rror" "$WORK/runs/$r/train.log" | tail -2
        cp "$WORK/runs/$r/metrics.jsonl" "$OUT/metrics_$r.jsonl" 2>/dev/null || true; done
}

steps_of() { { ls -d "$WORK/runs/$1"/checkpoints/step_*/drafter 2>/dev/null || true; } | sed 's|.*/step_0*\([0-9][0-9]*\)/drafter|\1|'; }

part_eval() {
    local step; step=$(comm -12 <(steps_of A | sort) <(steps_of B | sort) | sort -n | tail -1)
    [ -n "$step" ] || { say "eval: no common checkpoint step"; return 1; }
    say "eval at step $step"
    local d=(); for r in A B; do d+=("$(printf "%s/runs/%s/checkpoints/step_%06d/drafter" "$WORK" "$r" "$step")"); done
    for set in broad prompts; do
        $PY eval_dflash.py --method walk --target "$SMOL" --drafter "${d[@]}" --prompts data/default/eval_$set.jsonl \
            "${LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype float32 --device "$DEV" --skip-long \
            --out "$OUT/walk_$set.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -25
        $PY -m tools.tau_diff "$OUT/walk_$set.json" | tee "$OUT/tau_diff_$set.txt" || say "tau_diff $set failed"
    done
    local best; best=$($PY -c "import json; r=json.load(open('$OUT/walk_broad.json')); r=r.get('drafters',[r])
print(max(r, key=lambda x: x.get('tau_macro', x['tau']))['drafter'])")
    say "best on the broad set: $best"
    $PY eval_dflash.py --method fast --target "$SMOL" --drafter "$best" --prompts data/default/eval_broad.jsonl \
        "${LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype bfloat16 --device "$DEV" --skip-long \
        --out "$OUT/fast_bf16.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -14
    $PY eval_dflash.py --method fast --target "$SMOL" --drafter "$best" --prompts data/default/eval_broad.jsonl \
        "${LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype float32 --drafter-dtype bfloat16 --device "$DEV" --skip-long \
        --out "$OUT/fast_fp32_bf16drafter.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -14
}

for p in $PART; do
    case $p in setup1|setup2|gen|prep|train|eval) say "part $p"; part_$p ;;
        *) echo "unknown PART=$p (setup1 setup2 gen prep train eval)"; exit 2 ;; esac
done
say "PART=$PART done"
