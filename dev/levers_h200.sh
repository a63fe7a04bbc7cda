#!/usr/bin/env bash
# The general-recipe levers on the real SmolLM2, judged on the broad per-category set (macro tau), one round per
# GPU lease. Each round generates its sets, trains its arms side by side on one GPU at equal data and steps, walks
# them on the broad set and the 204-prompt set, diffs every arm against the first (paired SE per category and macro),
# and runs the fast decode loop on the best (bf16, and fp32 target + bf16 drafter with either attention; the step
# times of both attentions by count_ops). Parts fit 10-minute device calls
# and resume from what the last left under $WORK:
#   PART=setup1   wheels from .whl/ into /tmp/site; the GGUF's first half (.gguf/part-aa) to $WORK; the GPU tests
#                 (GPU_TESTS=0 skips them)
#   PART=setup2   join with .gguf/part-ab and convert (tools.smollm2)
#   PART=gen      the round's sets (data.synthesize, resumable: rerun to go on), all bounded by GEN_SECONDS
#   PART=prep     data.prepare of each arm's rows
#   PART=train    the arms side by side, STEPS each, bounded by TRAIN_SECONDS (rerun: RESUME=auto goes on)
#   PART=eval     walk tau (fp32) at the arms' common checkpoint step, tau_diff, the fast loop on the best,
#                 $OUT/summary.json (per arm: macro, categories, the 204-prompt tau, training seconds)
# Rounds (ROUND=1..4; SETS and ARMS override them):
#   1  what the prompts are: code-leaning openers (today's) against general openers, 20% two-turn, and the same
#      with a system prompt per conversation (--systems); the general arm again at another training seed, for the
#      spread that a difference is read against
#   2  what the answers are, on round 1's winner (WIN_OPENERS, WIN_SYSTEMS): a 384- against a 768-token answer cap,
#      half the answers sampled at T=0.6, 40% two-turn
#   3  how much and how long, on the winner's recipe: 3,000 steps against 1,200 on 12K conversations, then 36K
#      conversations at 3,000 steps (tau against training seconds: summary.json has both)
#   4  the drafter's shape at equal data and steps: BLOCK_SIZE 8, 8 layers, against 16 and 5 (a comparison at equal
#      steps is one at equal GPU time only where the steps cost the same: read the arms' training seconds)
#   5  four arms in one short lease: 12K conversations (20% two-turn) at two seeds; 16.8K at the same steps (more
#      data at equal training time); 30% of the 12K under a system prompt
# Specs: SETS="name:rows:openers:turns:seed:temperature:answer_cap:systems ..." (openers/systems: a file under
# data/default without .jsonl, "-" for none); ARMS="name:set[@rows]+set[@rows]:--FLAG=V,--FLAG=V ..." (set@N: its
# first N rows). The first arm is the baseline of every diff.
#   SMOKE=1 WORK=/tmp/lv SMOL=~/.cache/dflash/smollm2-135m-instruct PART="gen prep train eval" bash dev/levers_h200.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${PART:-"setup2 gen prep train eval"}
ROUND=${ROUND:-1}
WORK=${WORK:-/root/lv}
OUT=${OUT:-$WORK/out}
PY=${PY:-python3}
SMOL=${SMOL:-$WORK/smollm2-135m-instruct}
SMOKE=${SMOKE:-0}
WIN_OPENERS=${WIN_OPENERS:-openers_general}   # round 1's winner, for rounds 2 and 3
WIN_SYSTEMS=${WIN_SYSTEMS:--}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK/gen" "$OUT"
if [ "$SMOKE" = 1 ]; then   # a few rows and steps: the whole chain on a CPU in minutes
    K=${K:-6}; SLOTS=8; STEPS=${STEPS:-4}; BUDGET=512; ANCHORS=16; LAYERS=1; DEV=cpu; DT=float32; EVAL_NEW=16
    LIM=(--limit 4); FAST_LIM=(--limit 4); LOG_EVERY=1
else
    K=${K:-6000}; SLOTS=2048; STEPS=${STEPS:-1200}; BUDGET=8192; ANCHORS=4096; LAYERS=5; DEV=cuda; DT=bfloat16
    EVAL_NEW=128; LIM=(); LOG_EVERY=100
    FAST_LIM=(--limit "${FAST_LIMIT:-100}")   # batch-1 decoding: 10 prompts a category, ~1 minute per dtype
fi
# an arm trains on 2K rows (K=6000 on the GPU: 12,000; round 3's large arm 6K = 36,000): k N is N tenths of K
k() { echo $(( $1 * K / 10 )); }
case $ROUND in
    1) SETS=${SETS:-"code:$(k 20):openers:1:0:0:384:- gen1:$(k 16):openers_general:1:0:0:384:- \
gen2:$(k 4):openers_general:2:1:0:384:- sys1:$(k 16):openers_general:1:0:0:384:systems \
sys2:$(k 4):openers_general:2:1:0:384:systems"}
       # general_s1: the same data, another training seed: the seeds' spread on the broad macro, in the same round
       ARMS=${ARMS:-"code:code: general:gen1+gen2: systems:sys1+sys2: general_s1:gen1+gen2:--SEED=1"} ;;
    2) W="$WIN_OPENERS"; S="$WIN_SYSTEMS"
       SETS=${SETS:-"w1:$(k 16):$W:1:0:0:384:$S w2:$(k 8):$W:2:1:0:384:$S long1:$(k 16):$W:1:0:0:768:$S \
long2:$(k 4):$W:2:1:0:768:$S t6:$(k 8):$W:1:2:0.6:384:$S"}
       ARMS=${ARMS:-"base:w1+w2@$(k 4): cap768:long1+long2: sampled:w1@$(k 8)+t6+w2@$(k 4): turns40:w1@$(k 12)+w2@$(k 8):"} ;;
    3) W="$WIN_OPENERS"; S="$WIN_SYSTEMS"
       SETS=${SETS:-"w1:$(k 48):$W:1:0:0:384:$S w2:$(k 12):$W:2:1:0:384:$S"}
       ARMS=${ARMS:-"base:w1@$(k 16)+w2@$(k 4): steps3000:w1@$(k 16)+w2@$(k 4):--MAX_STEPS=$(( STEPS * 5 / 2 )) \
data3x:w1+w2:--MAX_STEPS=$(( STEPS * 5 / 2 ))"} ;;
    4) W="$WIN_OPENERS"; S="$WIN_SYSTEMS"
       SETS=${SETS:-"w1:$(k 16):$W:1:0:0:384:$S w2:$(k 4):$W:2:1:0:384:$S"}
       ARMS=${ARMS:-"base:w1+w2: block8:w1+w2:--BLOCK_SIZE=8 layers8:w1+w2:--NUM_DRAFT_LAYERS=8"} ;;
    5) W="$WIN_OPENERS"   # round 1 left undone: system prompts; then data at equal steps, and the seed spread
       SETS=${SETS:-"w1:$(k 24):$W:1:0:0:384:- w2:$(k 4):$W:2:1:0:384:- s1:$(k 6):$W:1:2:0:384:systems"}
       ARMS=${ARMS:-"base:w1@$(k 16)+w2: base_s1:w1@$(k 16)+w2:--SEED=1 data1.4x:w1+w2: systems:w1@$(k 10)+s1+w2:"} ;;
    *) echo "ROUND=$ROUND: 1, 2, 3, 4 or 5"; exit 2 ;;
esac
T0=$(date +%s)
say() { echo "[levers $(( $(date +%s) - T0 ))s] $*"; }

part_setup1() {
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    cp .gguf/part-aa "$WORK/gguf.part-aa"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    # the GPU paths the CPU suite cannot reach, on this machine's torch: every test of tests/gpu (flex attention, FP8,
    # the CE kernel, the fast loop's CUDA graphs with DFlash and DFlash2, the optimizer's side stream; test_train_cuda.py
    # skips on one GPU)
    [ "${GPU_TESTS:-1}" = 1 ] && { timeout 300 $PY -m pytest -q -o addopts=-rs -p no:cacheprovider \
        tests/gpu > "$OUT/gpu_tests.txt" 2>&1 || true
        tail -4 "$OUT/gpu_tests.txt"; }
    return 0
}

part_setup2() {
    [ -f "$SMOL/config.json" ] && return 0
    cat "$WORK/gguf.part-aa" .gguf/part-ab > "$WORK/smollm2.gguf"
    $PY -m tools.smollm2 --gguf "$WORK/smollm2.gguf" --out "$SMOL"
}

opt_file() { [ "$2" = - ] || echo "$1 data/default/$2.jsonl"; }

part_gen() {
    local t_end=$(( $(date +%s) + ${GEN_SECONDS:-100000} )) name rows op turns seed temp cap sys
    for s in $SETS; do
        IFS=: read -r name rows op turns seed temp cap sys <<< "$s"
        local f=$WORK/gen/$name.jsonl left=$(( t_end - $(date +%s) )) ptok=128
        [ "$SMOKE" = 1 ] && { cap=16; ptok=32; }
        [ -f "$f" ] && [ "$(wc -l < "$f")" -ge "$rows" ] && { say "$name: $rows rows already"; continue; }
        [ "$left" -gt 20 ] || { say "$name: GEN_SECONDS spent: rerun PART=gen to go on"; continue; }
        # (--mix: 2% of the rows answer the shipped training prompts, as every recipe so far)
        timeout -s TERM "$left" $PY -m data.synthesize --model "$SMOL" --num "$rows" --out "$f" --seed "$seed" \
            --turns "$turns" --mix data/default/train_prompts.jsonl --mix-ratio 0.02 --max-new-tokens "$cap" \
            --prompt-tokens "$ptok" $(opt_file --openers "$op") $(opt_file --systems "$sys") --temperature "$temp" \
            --prompt-temperature 1.0 --batch-size "$SLOTS" --attention matmul \
            $( [ "$SMOKE" = 1 ] || echo --compile-sampler ) --device "$DEV" --dtype "$DT" 2>&1 | tr '\r' '\n' | \
            grep -v "%|" | tail -4 || say "$name stopped (rc $?): rerun PART=gen to go on"
        say "$name: $(wc -l < "$f") of $rows rows"
        cp "$f.stats.json" "$OUT/gen_stats_$name.json" 2>/dev/null || true
    done
}

# arm_files ARM_SETS: the files data.prepare reads for "a+b@N" (b@N: the first N rows of b, cut to $WORK/gen)
arm_files() {
    local part set n
    for part in ${1//+/ }; do
        set=${part%@*}; n=${part#*@}
        if [ "$n" = "$part" ]; then echo "$WORK/gen/$set.jsonl"
        else head -n "$n" "$WORK/gen/$set.jsonl" > "$WORK/gen/${set}_first$n.jsonl"; echo "$WORK/gen/${set}_first$n.jsonl"; fi
    done
}

part_prep() {
    local name sets extra
    for a in $ARMS; do
        IFS=: read -r name sets extra <<< "$a"
        # shellcheck disable=SC2046
        $PY -m data.prepare --tokenizer "$SMOL" --out "$WORK/prep_$name" --max-len 2048 --overwrite \
            $(arm_files "$sets") | tail -1
        cp "$WORK/prep_$name/stats.json" "$OUT/prep_${name}_stats.json"
    done
}

part_train() {
    local pids=() name sets extra
    for a in $ARMS; do
        IFS=: read -r name sets extra <<< "$a"
        mkdir -p "$WORK/runs/$name"
        # later flags win: an arm's own --MAX_STEPS or --BLOCK_SIZE replaces the common one
        timeout -s TERM "${TRAIN_SECONDS:-100000}" $PY train_dflash.py --TARGET="$SMOL" --DATA="$WORK/prep_$name" \
            --OUT_DIR="$WORK/runs/$name" --DEVICE="$DEV" --TOKEN_BUDGET="$BUDGET" --MAX_BATCH_SIZE=64 \
            --MAX_ANCHORS="$ANCHORS" --BLOCK_SIZE=16 --NUM_DRAFT_LAYERS="$LAYERS" --MAX_STEPS="$STEPS" --LR=6e-4 \
            --SAVE_EVERY=$(( STEPS / 4 > 0 ? STEPS / 4 : 1 )) --KEEP_LAST=12 --LOG_EVERY="$LOG_EVERY" ${extra//,/ } \
            >> "$WORK/runs/$name/train.log" 2>&1 &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    for a in $ARMS; do IFS=: read -r name sets extra <<< "$a"
        echo "== $name"; grep -a "step=\|done\|rror" "$WORK/runs/$name/train.log" | tail -2
        cp "$WORK/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null || true; done
}

steps_of() { { ls -d "$WORK/runs/$1"/checkpoints/step_*/drafter 2>/dev/null || true; } | sed 's|.*/step_0*\([0-9][0-9]*\)/drafter|\1|'; }

part_eval() {
    # every arm at the largest checkpoint step all have (an arm with a longer schedule at its own last step)
    local name sets extra step="" d=() n=0
    for a in $ARMS; do IFS=: read -r name sets extra <<< "$a"; [[ "$extra" == *MAX_STEPS* ]] || n=$((n + 1)); done
    step=$(for a in $ARMS; do IFS=: read -r name sets extra <<< "$a"; [[ "$extra" == *MAX_STEPS* ]] || steps_of "$name" | sort -u; done | \
        sort -n | uniq -c | awk -v n="$n" '$1 == n {s = $2} END {print s}')
    [ -n "$step" ] || { say "eval: no common checkpoint step"; return 1; }
    for a in $ARMS; do
        IFS=: read -r name sets extra <<< "$a"
        local s=$step; [[ "$extra" == *MAX_STEPS* ]] && s=$(steps_of "$name" | sort -n | tail -1)
        local dir; dir=$(printf "%s/runs/%s/checkpoints/step_%06d/drafter" "$WORK" "$name" "${s:-0}")
        if [ -d "$dir" ]; then d+=("$dir"); else say "eval: $name has no checkpoint at step ${s:-none}: left out"; fi
    done
    say "eval at step $step: ${#d[@]} arms"
    for set in broad prompts; do
        $PY eval_dflash.py --method walk --target "$SMOL" --drafter "${d[@]}" --prompts data/default/eval_$set.jsonl \
            "${LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype float32 --device "$DEV" --skip-long \
            --out "$OUT/walk_$set.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -30
        [ ${#d[@]} -gt 1 ] && { $PY -m tools.tau_diff "$OUT/walk_$set.json" | tee "$OUT/tau_diff_$set.txt" || say "tau_diff $set failed"; }
    done
    local best; best=$($PY -c "import json; r=json.load(open('$OUT/walk_broad.json')); r=r.get('drafters',[r])
print(max(r, key=lambda x: x.get('tau_macro', x['tau']))['drafter'])")
    say "best by macro tau on the broad set: $best"
    $PY eval_dflash.py --method fast --target "$SMOL" --drafter "$best" --prompts data/default/eval_broad.jsonl \
        "${FAST_LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype bfloat16 --device "$DEV" --skip-long \
        --out "$OUT/fast_bf16.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -8
    # the lossless speedup with each attention: the fp32 efficient-attention kernel took 125 us a call in greedy
    # and verify alike (h200_s10), so the fp32 baseline itself may be slow; the matmul one is run with its own
    # (equally fast-attention) greedy baseline
    for attn in sdpa matmul; do local sfx=""; [ $attn = matmul ] && sfx=_matmul
        $PY eval_dflash.py --method fast --target "$SMOL" --drafter "$best" --prompts data/default/eval_broad.jsonl \
            "${FAST_LIM[@]}" --max-new-tokens "$EVAL_NEW" --dtype float32 --drafter-dtype bfloat16 --device "$DEV" \
            --skip-long --attention $attn --out "$OUT/fast_fp32_bf16drafter$sfx.json" 2>&1 | \
            grep -v "^Loading\|it/s\]" | tail -8; done
    # where the lossless step's time goes (fp32 target, bf16 drafter): kernels by device time; then each dtype's
    # and attention's step times (CUDA-graph replays) side by side
    # COUNT_OPS=0: no profile or step timings (a lease short of time); the summary below still runs
    local reps=200 prof=(--profile 10); [ "$SMOKE" = 1 ] && { reps=2; prof=(); }
    if [ "${COUNT_OPS:-1}" = 1 ]; then
        $PY -m tools.count_ops --target "$SMOL" --device "$DEV" --dtype float32 --drafter-dtype bfloat16 \
            --drafter-layers "$LAYERS" --max-len 1024 "${prof[@]}" > "$OUT/fast_steps_fp32_bf16drafter.txt" 2>&1 || \
            say "count_ops failed (rc $?)"
        for dt in float32 bfloat16; do for attn in sdpa matmul; do
            $PY -m tools.count_ops --target "$SMOL" --device "$DEV" --dtype $dt --drafter-dtype bfloat16 \
                --drafter-layers "$LAYERS" --max-len 1024 --attention $attn --time $reps 2>&1 | grep -a "time per step"
        done; done | tee "$OUT/fast_steps_attention.txt"
    fi
    for a in $ARMS; do IFS=: read -r name sets extra <<< "$a"     # (each device call has its own $OUT)
        cp "$WORK/prep_$name/stats.json" "$OUT/prep_${name}_stats.json" 2>/dev/null || true
        cp "$WORK/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null || true; done
    $PY -m dev.levers_summary --out "$OUT" --round "$ROUND" --arms "$ARMS" --sets "$SETS" | tee "$OUT/summary.txt"
}

for p in $PART; do
    case $p in setup1|setup2|gen|prep|train|eval) say "part $p (round $ROUND)"; part_$p ;;
        *) echo "unknown PART=$p (setup1 setup2 gen prep train eval)"; exit 2 ;; esac
done
say "PART=$PART done"
