#!/usr/bin/env bash
# The data-at-scale and quality runs on one GPU (BENCHMARKS.md), in
# parts that each fit one 10-minute device call and resume from what the previous part left under $WORK:
#   PART=setup1  wheels from .whl/ into /tmp/site; the first half of the SmolLM2 GGUF (.gguf/part-aa) to $WORK
#   PART=setup2  join the GGUF with .gguf/part-ab, convert it (tools.smollm2), engine == HF generate on SmolLM2
#   PART=gen     data.synthesize: NUM conversations (self-written + MIX_RATIO shipped prompts), bounded by
#                GEN_SECONDS (SIGTERM; rerun the part to go on: the run is resumable)
#   PART=pack    the generated sets (GEN_SETS, with their rejected rows and stats: what a resumed data.synthesize reads) as
#                xz pieces of PIECE_BYTES in $WORK/home with a MANIFEST (sha256, rows), for dev/pipeline_h200.sh's
#                poll to bring home: a later lease carries them back (.data/gen) and resumes instead of regenerating
#   PART=unpack  copy the carried pieces of .data/gen to $WORK/home_in (one call may carry some, the next the rest);
#                once all the MANIFEST names are there, check the sha256 and extract them under $WORK/gen
#   PART=prep    data.prepare of the first 1K / 10K / 30K / all rows (the curve's data sizes)
#   PART=train   the curve's drafters (RUNS, one process each, sharing the GPU), bounded by TRAIN_SECONDS; with
#                TRAIN_MODE=alone one after another, each ALONE_SECONDS with the GPU to itself (equal GPU time)
#                (SIGTERM saves a checkpoint; rerun the part to go on: RESUME=auto)
#   PART=eval    tau of every run's last checkpoint on the held-out prompts (walk: exact tau from one teacher-forced
#                pass, fp32), then the decode loop on the best one (tau cross-check, losslessness, tokens/s)
#   PART=all     setup2 gen prep train eval, for a machine where one process may run for hours
#   PART=gen WORK=/tmp/q SMOL=~/.cache/dflash/smollm2-135m-instruct SMOKE=1 bash dev/quality_h200.sh   # CPU rehearsal
# SMOKE=1 shrinks every number (a few rows, a few steps) so the whole chain runs on a CPU in minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PART=${PART:-all}
WORK=${WORK:-/root/q}
OUT=${OUT:-$WORK/out}
PY=${PY:-python3}
SMOL=${SMOL:-$WORK/smollm2-135m-instruct}
export DFLASH_CACHE=${DFLASH_CACHE:-$WORK}
SMOKE=${SMOKE:-0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True TOKENIZERS_PARALLELISM=false
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK" "$OUT"
if [ "$SMOKE" = 1 ]; then
    NUM=${NUM:-24}; SLOTS=${SLOTS:-8}; NEW=${NEW:-24}; PTOK=${PTOK:-32}; SIZES=${SIZES:-8 16 all free8}
    STEPS=${STEPS:-4}; BUDGET=${BUDGET:-512}; ANCHORS=${ANCHORS:-16}; LAYERS=${LAYERS:-1}; EVAL_LIMIT=${EVAL_LIMIT:-3}
    EVAL_NEW=${EVAL_NEW:-16}; DEV=cpu; DT=float32; LOG_EVERY=${LOG_EVERY:-1}; PROBE_STEPS=${PROBE_STEPS:-4}
    ALONE_SECONDS=${ALONE_SECONDS:-10}
else
    NUM=${NUM:-100000}; SLOTS=${SLOTS:-1024}; NEW=${NEW:-384}; PTOK=${PTOK:-128}; SIZES=${SIZES:-1000 10000 30000 all free30000}
    STEPS=${STEPS:-1500}; BUDGET=${BUDGET:-8192}; ANCHORS=${ANCHORS:-512}; LAYERS=${LAYERS:-5}; EVAL_LIMIT=${EVAL_LIMIT:-0}
    EVAL_NEW=${EVAL_NEW:-128}; DEV=cuda; DT=bfloat16; LOG_EVERY=${LOG_EVERY:-50}; PROBE_STEPS=${PROBE_STEPS:-150}
    ALONE_SECONDS=${ALONE_SECONDS:-240}
fi
GEN=${GEN:-$WORK/gen/smollm2.jsonl}   # the set PART=gen writes (tops up) and PART=prep's sizes cut; TEMP its answers
TEMP=${TEMP:-0.6}                     # temperature (0 = greedy); set_NAME sizes read $WORK/gen/NAME.jsonl whole
GEN_SETS=${GEN_SETS:-smollm2}         # the sets PART=pack / unpack move: $WORK/gen/NAME.jsonl and its side files
OPENERS=${OPENERS-data/default/openers.jsonl}    # OPENERS= : the model writes every prompt free
# name:data-size:extra flags, comma-separated (the curve at one recipe; then at the largest size the D-PACE lever and the two FP8
# switches, whose tau cost is measured at equal data and steps)
RUNS=${RUNS:-"c1k:1000: c10k:10000: c30k:30000: call:all: dpace:all:--LOSS_WEIGHTING=dpace tfp8:all:--TARGET_FP8=1 dfp8:all:--DRAFTER_FP8=1"}
[ "$SMOKE" = 1 ] && RUNS=${SMOKE_RUNS:-"c8:8: call:all: dpace:all:--LOSS_WEIGHTING=dpace"}
T0=$(date +%s)
say() { echo "[quality $(( $(date +%s) - T0 ))s] $*"; }

part_setup1() {
    ls .whl/*.whl >/dev/null && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    cp .gguf/part-aa "$WORK/gguf.part-aa"
    PYTHONPATH=/tmp/site $PY -c "import datasets, pyarrow, datasketch, gguf; print('datasets', datasets.__version__, 'pyarrow', pyarrow.__version__)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
}

part_setup2() {
    if [ ! -f "$SMOL/config.json" ]; then
        mkdir -p "$WORK/gguf"
        cat "$WORK/gguf.part-aa" .gguf/part-ab > "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
        md5sum "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
        $PY -m tools.smollm2 --gguf "$WORK/gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --out "$SMOL"
    fi
    # the engine's greedy output against HF generate on the real target, on this GPU, with CUDA graphs
    [ "${CHECK_ENGINE:-1}" = 1 ] && $PY -m pytest -q -x tests/unit/test_engine.py -k "smollm2" -p no:cacheprovider 2>&1 | tail -3
    return 0
}

part_gen() {
    mkdir -p "$(dirname "$GEN")"
    timeout -s TERM "${GEN_SECONDS:-100000}" $PY -m data.synthesize --model "$SMOL" --num "$NUM" --out "$GEN" --seed 0 \
        --mix data/default/train_prompts.jsonl --mix-ratio 0.02 --max-new-tokens "$NEW" --prompt-tokens "$PTOK" \
        $( [ -n "$OPENERS" ] && echo --openers "$OPENERS" ) \
        --temperature "$TEMP" --prompt-temperature 1.0 --batch-size "$SLOTS" --attention "${ATTN:-sdpa}" \
        $( [ "${SAMPLER:-eager}" = compiled ] && echo --compile-sampler ) \
        --device "$DEV" --dtype "$DT" \
        2>&1 | tr '\r' '\n' | grep -v "^synthesize: *[0-9]*%|" | tail -40 || say "synthesize stopped (rc $?): rerun PART=gen to go on"
    say "rows in $GEN: $(wc -l < "$GEN")"
    cp "$GEN.stats.json" "$OUT/gen_stats_$(basename "$GEN" .jsonl).json" 2>/dev/null || true
}

# " NAME:rows" of every set in GEN_SETS that is under $WORK/gen
set_rows() { local s; for s in $GEN_SETS; do [ -f "$WORK/gen/$s.jsonl" ] && echo -n " $s:$(wc -l < "$WORK/gen/$s.jsonl")"; done; true; }
GEN_FILES=(); for s in $GEN_SETS; do GEN_FILES+=(gen/$s.jsonl gen/$s.jsonl.rejected.jsonl gen/$s.jsonl.stats.json); done
# xz, or Python's lzma (the same format, one thread) where the machine has no xz
xz_c() { if command -v xz > /dev/null; then xz -T"${PACK_THREADS:-4}" -6; else $PY -c "import lzma, shutil, sys
with lzma.open(sys.stdout.buffer, 'wb', preset=6) as f: shutil.copyfileobj(sys.stdin.buffer, f)"; fi; }
xz_d() { if command -v xz > /dev/null; then xz -d; else $PY -c "import lzma, shutil, sys
with lzma.open(sys.stdin.buffer) as f: shutil.copyfileobj(f, sys.stdout.buffer)"; fi; }

part_pack() {
    local files=(); for f in "${GEN_FILES[@]}"; do [ -f "$WORK/$f" ] && files+=("$f"); done
    [ ${#files[@]} -gt 0 ] || { say "pack: none of the sets $GEN_SETS is under $WORK/gen"; return 0; }
    rm -rf "$WORK/home" && mkdir -p "$WORK/home"
    tar -C "$WORK" -cf - "${files[@]}" | xz_c | \
        split -b "${PIECE_BYTES:-15000000}" -d -a 2 - "$WORK/home/gen.tar.xz.part-"
    { echo "rows$(set_rows)"
      echo "files ${files[*]}"
      (cd "$WORK/home" && cat gen.tar.xz.part-* | sha256sum | sed 's/-$/gen.tar.xz/'; ls gen.tar.xz.part-* | sed 's/^/piece /')
    } > "$WORK/home/MANIFEST"
    say "pack: $(grep '^rows' "$WORK/home/MANIFEST") in $(ls "$WORK/home" | grep -c part) pieces, $(du -sh "$WORK/home" | cut -f1)"
}

part_unpack() {
    mkdir -p "$WORK/home_in"
    cp .data/gen/* "$WORK/home_in/" 2>/dev/null || true
    [ -f "$WORK/home_in/MANIFEST" ] || { say "unpack: no MANIFEST carried yet (.data/gen/MANIFEST)"; return 0; }
    local missing; missing=$(awk '$1 == "piece" {print $2}' "$WORK/home_in/MANIFEST" | \
        while read -r f; do [ -f "$WORK/home_in/$f" ] || echo "$f"; done | tr '\n' ' ')
    [ -z "$missing" ] || { say "unpack: still to carry: $missing"; return 0; }
    local want got; want=$(awk '$2 == "gen.tar.xz" {print $1}' "$WORK/home_in/MANIFEST")
    got=$(cd "$WORK/home_in" && cat gen.tar.xz.part-* | sha256sum | cut -d" " -f1)
    [ "$want" = "$got" ] || { say "unpack: sha256 $got != MANIFEST's $want: carry the pieces again"; return 1; }
    (cd "$WORK/home_in" && cat gen.tar.xz.part-*) | xz_d | tar -C "$WORK" -xf -
    say "unpack: rows$(set_rows) (MANIFEST: $(grep '^rows' "$WORK/home_in/MANIFEST")); PART=gen resumes from them"
}

part_prep() {
    for n in $SIZES; do
        local src=$GEN
        [ "$n" = ship ] && continue                      # the shipped set, data/default/smollm2, already prepared
        # freeN: the first N rows no opener steered (--openers' "free" share, and the shipped prompts)
        # (awk, not grep | head: head's early exit is a SIGPIPE that pipefail and errexit turn into this part's end)
        case $n in all) ;; set_*) src=$WORK/gen/${n#set_}.jsonl ;;
                   free*) src=$WORK/gen/$n.jsonl
                                  awk -v n="${n#free}" '!/"opener": / {print; if (++k == n) exit}' "$GEN" > "$src" ;;
                   *) src=$WORK/gen/first_$n.jsonl; head -n "$n" "$GEN" > "$src" ;; esac
        [ -f "$WORK/prep_$n/stats.json" ] && [ "$n" != all ] && continue
        $PY -m data.prepare --tokenizer "$SMOL" --out "$WORK/prep_$n" --max-len 2048 --overwrite "$src" 2>&1 | tail -4
        cp "$WORK/prep_$n/stats.json" "$OUT/prep_${n}_stats.json"
    done
}

# one run in the foreground, SIGTERM after SECONDS (it saves a checkpoint and stops; RESUME=auto goes on):
# train_one SECONDS DATA OUT_DIR [more --NAME=VALUE, later ones win]
train_one() {
    local secs=$1 data=$2 out=$3; shift 3
    mkdir -p "$out"
    # one process per run (target forward on its feeder thread, drafter on the main thread)
    timeout -s TERM "$secs" $PY train_dflash.py --TARGET="$SMOL" --DATA="$data" \
        --OUT_DIR="$out" --DEVICE="$DEV" --TOKEN_BUDGET="$BUDGET" --MAX_BATCH_SIZE=64 \
        --MAX_ANCHORS="$ANCHORS" --BLOCK_SIZE=16 --NUM_DRAFT_LAYERS="$LAYERS" --MAX_STEPS="$STEPS" \
        --LR=6e-4 --SAVE_EVERY=${SAVE_EVERY:-$(( STEPS / 3 > 0 ? STEPS / 3 : 1 ))} --KEEP_LAST=5 --LOG_EVERY="$LOG_EVERY" "$@" \
        >> "$out/train.log" 2>&1
}

run_data() { if [ "$1" = ship ]; then echo data/default/smollm2; else echo "$WORK/prep_$1"; fi; }

report_runs() {
    local name size extra
    for run in $RUNS; do
        IFS=: read -r name size extra <<< "$run"
        echo "== $name ($size rows $extra)"; grep -a "step=\|done\|error\|Error" "$WORK/runs/$name/train.log" | tail -3
        cp "$WORK/runs/$name/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null || true
    done
}

part_train() {
    [ "${TRAIN_MODE:-together}" = alone ] && { train_alone; return; }
    local pids=() name size extra
    for run in $RUNS; do
        IFS=: read -r name size extra <<< "$run"
        extra=${extra//,/ }        # several flags: --A=1,--B=2
        # all runs at once, sharing the one GPU
        train_one "${TRAIN_SECONDS:-100000}" "$(run_data "$size")" "$WORK/runs/$name" $extra &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || true; done
    report_runs
}

# TRAIN_MODE=alone: equal GPU time. The runs one after another, each with the GPU to itself for ALONE_SECONDS of
# training (loading not counted): a throwaway probe of PROBE_STEPS measures the run's own steps/s alone (over its
# last logged interval, so start-up and the compiles of new shapes are left out: from its first logged step, the
# 2026-12-03 probes read 4.6 steps/s where the runs then trained at ~8), and the run gets MAX_STEPS = that rate
# x ALONE_SECONDS, its cosine schedule ending there. A run's --MAX_STEPS in RUNS is replaced.
train_alone() {
    local name size extra rate n t0; t0=$(date +%s)
    for run in $RUNS; do
        IFS=: read -r name size extra <<< "$run"
        extra=${extra//,/ }
        local flags=(); for f in $extra; do [[ "$f" == --MAX_STEPS=* ]] || flags+=("$f"); done
        local left=$(( ${TRAIN_SECONDS:-100000} - ($(date +%s) - t0) ))
        [ "$left" -gt $(( ALONE_SECONDS / 2 )) ] || { say "alone: $name: $left s of TRAIN_SECONDS left: not started"; continue; }
        # a rerun (the part restarted after a cut) keeps the MAX_STEPS it probed before: its run resumes on the
        # schedule it started with instead of a re-planned one (read empties rate and n when there is none)
        read -r rate n < <(awk -v r="$name" '$1 == r {print $2, $3}' "$OUT/alone_rates.txt" 2>/dev/null | tail -1) || true
        if [ -n "${n:-}" ]; then
            say "alone: $name: MAX_STEPS=$n as probed before ($rate steps/s, $OUT/alone_rates.txt)"
        else
            rm -rf "$WORK/probe/$name"
            train_one "$left" "$(run_data "$size")" "$WORK/probe/$name" "${flags[@]}" --MAX_STEPS="$PROBE_STEPS" --LOG_EVERY=$(( PROBE_STEPS / 4 > 0 ? PROBE_STEPS / 4 : 1 )) \
                --SAVE_EVERY=1000000 --KEEP_LAST=1 || true
            rate=$($PY -c "import json, sys
m = [json.loads(l) for l in open(sys.argv[1])]
a = m[-2] if len(m) > 2 else m[0]   # the last interval: the first ones still compile new shapes
print(f'{(m[-1][\"step\"] - a[\"step\"]) / (m[-1][\"elapsed_s\"] - a[\"elapsed_s\"]):.3f}' if len(m) > 1 else '')" \
                "$WORK/probe/$name/metrics.jsonl" 2>/dev/null || true)
            [ -n "$rate" ] || { say "alone: $name's probe logged fewer than 2 lines ($WORK/probe/$name/train.log): left out"; continue; }
            n=$($PY -c "print(max(1, round($rate * $ALONE_SECONDS)))")
            say "alone: $name trains at $rate steps/s alone: MAX_STEPS=$n for ${ALONE_SECONDS} s"
            echo "$name $rate $n" >> "$OUT/alone_rates.txt"
        fi
        [ -d "$(printf "%s/checkpoints/step_%06d/drafter" "$WORK/runs/$name" "$n")" ] && \
            { say "alone: $name: already trained to step $n"; continue; }
        left=$(( ${TRAIN_SECONDS:-100000} - ($(date +%s) - t0) ))
        # checkpoints at each quarter: a run cut by the lease resumes from the last one
        train_one "$left" "$(run_data "$size")" "$WORK/runs/$name" "${flags[@]}" --MAX_STEPS="$n" \
            --SAVE_EVERY=$(( n / 4 > 0 ? n / 4 : 1 )) || true
    done
    report_runs
}

# (|| true: a run with no checkpoint yet, e.g. one that failed to start, is left out, not the end of the part)
last_drafter() { { ls -d "$WORK/runs/$1"/checkpoints/step_*/drafter 2>/dev/null || true; } | sort | tail -1; }
steps_of() { { ls -d "$WORK/runs/$1"/checkpoints/step_*/drafter 2>/dev/null || true; } | \
    sed 's|.*/step_0*\([0-9][0-9]*\)/drafter|\1|'; }

# EQUAL_STEPS=1: the largest checkpoint step that every run with a checkpoint has (runs sharing one GPU for one
# wall time reach different steps; the curve and the levers compare at equal steps)
common_step() {
    local name size extra n=0
    for run in $RUNS; do IFS=: read -r name size extra <<< "$run"; [ -n "$(steps_of "$name")" ] && n=$((n + 1)); done
    for run in $RUNS; do IFS=: read -r name size extra <<< "$run"; steps_of "$name" | sort -u; done | \
        sort -n | uniq -c | awk -v n="$n" '$1 == n {s = $2} END {print s}'
}

part_eval() {
    local drafters=() name size extra step=""
    [ "${EQUAL_STEPS:-0}" = 1 ] && step=$(common_step) && say "equal steps: evaluating every run at step ${step:-none}"
    for run in $RUNS; do
        IFS=: read -r name size extra <<< "$run"
        if [ -n "$step" ]; then d=$(printf "%s/checkpoints/step_%06d/drafter" "$WORK/runs/$name" "$step")
        else d=$(last_drafter "$name"); fi
        if [ -d "$d" ]; then drafters+=("$d"); else say "eval: $name has no checkpoint${step:+ at step $step}: left out"; fi
    done
    [ ${#drafters[@]} -gt 0 ] || { say "eval: no run has a checkpoint"; return 1; }
    local lim=(); [ "$EVAL_LIMIT" != 0 ] && lim=(--limit "$EVAL_LIMIT")
    tar czf "$OUT/runs_logs.tgz" -C "$WORK" $(cd "$WORK" && ls -d runs/*/train.log runs/*/metrics.jsonl runs/*/run.json 2>/dev/null) 2>/dev/null || true
    $PY eval_dflash.py --method walk --target "$SMOL" --drafter "${drafters[@]}" --prompts data/default/eval_prompts.jsonl \
        "${lim[@]}" --max-new-tokens "$EVAL_NEW" --dtype float32 --device "$DEV" --skip-long --out "$OUT/eval_walk.json" \
        2>&1 | grep -v "^Loading\|it/s\]" | tail -40
    # the same drafters on prompts of the training data's own kind (self-written, a seed no run trains on): tau
    # in distribution, against the held-out set's code and MT-Bench
    [ -f data/default/eval_self_prompts.jsonl ] && $PY eval_dflash.py --method walk --target "$SMOL" \
        --drafter "${drafters[@]}" --prompts data/default/eval_self_prompts.jsonl "${lim[@]}" --max-new-tokens "$EVAL_NEW" \
        --dtype float32 --device "$DEV" --skip-long --out "$OUT/eval_walk_self.json" 2>&1 | grep -v "^Loading\|it/s\]" | \
        tail -20 || say "the walk on eval_self_prompts.jsonl failed (rc $?)"
    # every run against the first, paired by prompt (the SE of the per-prompt differences; seeds add their own)
    for w in eval_walk eval_walk_self; do
        if [ -f "$OUT/$w.json" ] && [ ${#drafters[@]} -gt 1 ]; then
            $PY -m tools.tau_diff "$OUT/$w.json" | tee "$OUT/tau_diff_${w#eval_}.txt" || say "tau_diff on $w.json failed"
        fi
    done
    # the best by walk tau: the decode loop on the first prompts (tau must equal the walk's there), fp32 and bf16
    best=$($PY -c "import json,sys; r=json.load(open('$OUT/eval_walk.json')); r=r.get('drafters',[r]); print(max(r,key=lambda x:x['tau'])['drafter'])")
    say "best by walk tau: $best"
    [ "${DECODE:-1}" = 1 ] || return 0
    local method=(); $PY eval_dflash.py --help | grep -q -- "--method {[a-z,]*fast" && method=(--method fast)
    for dt in float32 bfloat16; do
        $PY eval_dflash.py "${method[@]}" --target "$SMOL" --drafter "$best" --prompts data/default/eval_prompts.jsonl \
            --limit "${DECODE_LIMIT:-24}" --max-new-tokens "$EVAL_NEW" --dtype $dt --device "$DEV" --skip-long \
            --out "$OUT/eval_decode_$dt.json" 2>&1 | grep -v "^Loading\|it/s\]" | tail -12
    done
    # where a speculative step's time goes against a greedy one's: graph replays timed, ops by device time
    # (COUNT_OPS=0: skipped; the steps' cost depends on the target and the drafter's shape, not on its weights)
    [ "${COUNT_OPS:-1}" = 1 ] || return 0
    local prof=(--time 200 --profile 10); [ "$SMOKE" = 1 ] && prof=(--time 2)
    for dt in float32 bfloat16; do
        $PY -m tools.count_ops --target "$SMOL" --device "$DEV" --dtype $dt --drafter-layers "$LAYERS" \
            --max-len 1024 "${prof[@]}" > "$OUT/fast_steps_$dt.txt" 2>&1 || say "count_ops $dt failed (rc $?)"
        grep -a "time per step\|Error" "$OUT/fast_steps_$dt.txt" || true
    done
}

case $PART in
    all) for p in setup2 gen prep train eval; do say "part $p"; part_$p; done ;;
    *) for p in $PART; do     # one part or several in order, e.g. PART="setup2 gen prep"
           case $p in setup1|setup2|unpack|gen|pack|prep|train|eval) say "part $p"; part_$p ;;
               *) echo "unknown PART=$p (setup1 setup2 unpack gen pack prep train eval all)"; exit 2 ;; esac
       done ;;
esac
say "PART=$PART done"
