#!/usr/bin/env bash
# One GPU lease's whole measurement as one background job, so no stage waits for a device call to start it and no
# call's 10-minute limit cuts a stage. From the device calls, back to back (the machine is given back after ~30 s
# idle, and everything under $WORK with it):
#   call 1: PART=setup1 WORK=/root/q bash bench/quality_h200.sh                       (carry .gguf/part-aa, .whl)
#   call 2: PART=setup2 WORK=/root/q bash bench/quality_h200.sh && bash bench/pipeline_h200.sh start   (.gguf/part-ab)
#   call 3..: bash bench/pipeline_h200.sh poll 540     (waits up to 540 s or until the job is done; results to $OUT)
# The job runs from a snapshot of the tree taken at start (later calls re-send the tree; a running script must not
# change under bash), except the eval stage, which snapshots the tree again when it starts: code sent by a poll
# call in the meantime is what it runs. Stages in order of what matters most (a lease that ends early loses the
# last), each bounded, the whole by DEADLINE seconds:
#   ab     the engine on the real SmolLM2 at 1024 slots, matmul attention: sampler eager vs compiled (-> SAMPLER),
#          then the faster at 2048 slots (-> SLOTS); bench.generate_bench
#   gen    data.synthesize, NUM conversations, GEN_SECONDS at most (resumable); the GPU tests run beside it
#   prep   the curve's data sizes
#   train  RUNS (bench/quality_h200.sh), TRAIN_SECONDS at most, checkpoints every SAVE_EVERY steps; STEPS must
#          end inside it (a run cut by time is evaluated mid-schedule)
#   eval   tau of every run at the largest checkpoint step all runs reached (equal steps), fast decode speed
#   fp8    bench.fp8_h200 (FP8 and the one-process trainer with COMPILE_TARGET) in what is left, FP8_SECONDS at most
# Measured on 2026-12-01 (BENCHMARKS.md sections 6, 7): 134 conv/s generated; five SmolLM2 runs side by side at
# ~6.3 steps/s each (600 steps in 96 s); walk eval of 5 drafters x 204 prompts ~70 s. A 30-minute lease: the first
# call may get no machine (~90 s), start + setup ~200 s, so DEADLINE 1350 leaves ~2 minutes to spare.
set -uo pipefail
cd "$(dirname "$0")/.."
WORK=${WORK:-/root/q}
export WORK
JOB=$WORK/job
mkdir -p "$JOB" "$WORK/out"

if [ "${1:-}" = start ]; then      # STAGES="train eval" bash bench/pipeline_h200.sh start: restart from a stage
    rm -rf "$WORK/repo" "$JOB/done"
    cp -a . "$WORK/repo"
    echo "$PWD" > "$JOB/live_tree"
    setsid nohup bash "$WORK/repo/bench/pipeline_h200.sh" run >> "$JOB/log" 2>&1 < /dev/null &
    echo $! > "$JOB/pid"
    echo "pipeline started (pid $!, stages ${STAGES:-all}), log $JOB/log"
    sleep "${START_WAIT:-20}"; tail -5 "$JOB/log"
    exit 0
fi

if [ "${1:-}" = stop ]; then
    kill -- -"$(cat "$JOB/pid")" 2>/dev/null && echo "pipeline stopped" || echo "no pipeline running"
    exit 0
fi

if [ "${1:-}" = poll ]; then
    end=$(( $(date +%s) + ${2:-540} ))
    while [ ! -f "$JOB/done" ] && [ "$(date +%s)" -lt "$end" ]; do sleep 5; done
    echo "== stage: $(cat "$JOB/stage" 2>/dev/null) $( [ -f "$JOB/done" ] && echo '(job done)')"
    grep -a -v "it/s\]\|s/it\]" "$JOB/log" | tail -${LINES_BACK:-60}
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
    [ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp "$JOB/log" "$WORK/out/pipeline.log" && tar czf "$OUT/results.tgz" -C "$WORK" out && \
        ls -la "$OUT"
    exit 0
fi

# --- the job (run from the snapshot) ---------------------------------------------------------------------------
STAGES=${STAGES:-ab gen prep train eval fp8}
want() { [[ " $STAGES " == *" $1 "* ]]; }
T0=$(date +%s)
DEADLINE=${DEADLINE:-1350}
# the plan inside DEADLINE: ab ~80 s, gen 700 s (~94K conversations at 2026-12-01's 134 conv/s), prep ~75 s, train
# ~215 s, eval ~150 s; FP8 gets what is left
export FP8_SECONDS=${FP8_SECONDS:-240} GEN_SECONDS=${GEN_SECONDS:-700}
if [ "${SMOKE:-0}" != 1 ]; then   # (SMOKE=1: bench/quality_h200.sh's own tiny numbers)
    # 1,200 steps: six SmolLM2 runs sharing one H200 at ~6 steps/s each (five did 600 in 96 s) end in ~215 s
    export STEPS=${STEPS:-1200} SAVE_EVERY=${SAVE_EVERY:-200}
    # the curve at the default recipe (D-PACE), the exp decay it replaced, and TARGET_FP8's tau cost, equal steps
    export RUNS=${RUNS:-"c1k:1000: c10k:10000: c30k:30000: call:all: exp:all:--LOSS_WEIGHTING=exp tfp8:all:--TARGET_FP8=1"}
fi
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
say() { echo "[pipeline $(( $(date +%s) - T0 ))s] $*"; }
stage() { echo "$1" > "$JOB/stage"; say "stage $1 ($(left) s left)"; }
export PY=${PY:-python3} OUT=$WORK/out PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site
export SMOL=${SMOL:-$WORK/smollm2-135m-instruct}
Q() { PART="$1" bash bench/quality_h200.sh; }
# SMOKE=1: a CPU rehearsal of the whole chain in minutes (tiny numbers; no GPU tests, no FP8)
AB=(--slots 1024 --prompts 2048 --new 256); AB2=(--slots 2048 --prompts 4096 --new 256)
[ "${SMOKE:-0}" = 1 ] && AB=(--slots 4 --prompts 8 --new 8 --device cpu) && AB2=(--slots 8 --prompts 8 --new 8 --device cpu)

ATTN=${ATTN:-sdpa} SAMPLER=${SAMPLER:-eager} SLOTS=${SLOTS:-1024}
if want ab; then
stage ab
# SDPA is left out: 10% slower than matmul on 2026-12-01 (BENCHMARKS.md section 7)
$PY -m bench.generate_bench --model "$SMOL" "${AB[@]}" --attention matmul --sampler eager,compiled \
    --temperature 0.6 2>&1 | grep -v Loading | tee "$OUT/engine_ab.txt"
# the fastest line (of one attention + sampler when given): "attention sampler slots"
rate() { awk -v a="${1:-}" -v m="${2:-}" '/^engine/ && (a == "" || ($2 == a && $3 == m)) {
    for (i = 2; i <= NF; i++) if ($i == "tok/s") { r = $(i - 1); gsub(",", "", r)
        if (r + 0 > best) {best = r + 0; at = $2; sm = $3; slots = $5}}} END {print at, sm, slots}' "$OUT/engine_ab.txt"; }
read -r ATTN SAMPLER _ <<< "$(rate)"
ATTN=${ATTN:-sdpa} SAMPLER=${SAMPLER:-eager}
$PY -m bench.generate_bench --model "$SMOL" "${AB2[@]}" --attention "$ATTN" --sampler "$SAMPLER" \
    --temperature 0.6 2>&1 | grep -v Loading | tee -a "$OUT/engine_ab.txt"
read -r _ _ SLOTS <<< "$(rate "$ATTN" "$SAMPLER")"
SLOTS=${SLOTS:-1024}
fi
export ATTN SAMPLER=${SAMPLER:-eager} SLOTS
say "engine: attention $ATTN, sampler $SAMPLER, $SLOTS slots"

if want gen; then
stage gen
tests_pid=
[ "${SMOKE:-0}" = 1 ] || { ( ONLY=tests bash bench/throughput_h200.sh "$OUT/gpu" > "$OUT/gpu_tests.txt" 2>&1 ) & tests_pid=$!; }
Q gen
head -n 200 "$WORK/gen/smollm2.jsonl" > "$OUT/gen_sample.jsonl"
[ -n "$tests_pid" ] && wait $tests_pid && tail -4 "$OUT/gpu_tests.txt"
fi

if want prep; then
stage prep
Q prep
fi

if want train; then
stage train
export TRAIN_SECONDS=$(( $(left) - ${EVAL_RESERVE:-150} - ${FP8_RESERVE:-0} ))
Q train
fi

if want eval; then
stage eval
live=$(cat "$JOB/live_tree")
rm -rf "$WORK/repo_eval" && cp -a "$live" "$WORK/repo_eval" && cd "$WORK/repo_eval"
EQUAL_STEPS=1 Q eval
cd - > /dev/null
fi
if want fp8; then
stage fp8
FP8_SECONDS=$(( $(left) < FP8_SECONDS ? $(left) : FP8_SECONDS ))
# the budget bounds each part from inside; timeout bounds a part stuck in a C call
[ "${SMOKE:-0}" = 1 ] || [ "$FP8_SECONDS" -lt 60 ] || timeout -s KILL $(( FP8_SECONDS + 30 )) $PY -m bench.fp8_h200 \
    --budget-s "$FP8_SECONDS" --json "$OUT/fp8.json" > "$OUT/fp8.txt" 2>&1
grep -v "Loading" "$OUT/fp8.txt" 2>/dev/null | tail -25
fi
stage done
say "pipeline done"
touch "$JOB/done"
