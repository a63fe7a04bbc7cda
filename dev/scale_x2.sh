#!/usr/bin/env bash
# The reference 8-GPU config scaled down to one nvidia-h200-x2 machine (TOKEN_BUDGET 49152, BLOCK_SIZE 32,
# MAX_ANCHORS 1024, GAMMA 10, GRAD_ACCUM 4, expandable_segments) with a random Qwen3-8B on 1 target + 1 drafter
# rank (NPROC, TARGETS; KILL_RANK: the rank B kills, default the first drafter, which writes the checkpoints),
# eager, in three runs:
#   A  uninterrupted, STEPS optimizer steps, a checkpoint every SAVE steps (the reference);
#   B  the same, with rank KILL_RANK killed (-9) after the status line of step KILL_AT: the time from the kill
#      to the end of the whole job, and the reason it printed;
#   C  B's OUT_DIR again with RESUME=auto: it must resume from B's last checkpoint and end where A ended.
#      (C writes into B's OUT_DIR: the compare reads runs A and B.)
# Then A's and C's status lines per step and their final checkpoints (drafter weights and AdamW state) compared.
#   bash dev/scale_x2.sh [OUT]     (OUT gets the logs and summary.txt; checkpoints go to RUNS, ~13 GB each)
# EXTRA: more --NAME=VALUE settings, after (and over) these (a CPU rehearsal on a tiny target sets its own).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/scale_x2}
ASSETS=${ASSETS:-/tmp/bench_assets}
RUNS=${RUNS:-/tmp/scale_runs}
PY=${PY:-python3}
STEPS=${STEPS:-6}; SAVE=${SAVE:-4}; KILL_AT=${KILL_AT:-5}
NPROC=${NPROC:-2}; TARGETS=${TARGETS:-1}; KILL_RANK=${KILL_RANK:-$TARGETS}   # x8: NPROC=8 TARGETS=5 (5 -> 3)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1
mkdir -p "$OUT"
rm -rf "$RUNS"
S="$OUT/summary.txt"; : > "$S"
[[ -f "$ASSETS/target/config.json" ]] || $PY -m bench.bench_dflash --write-assets "$ASSETS" --shape qwen3-8b > /tmp/scale_assets.txt 2>&1

run() {   # run NAME: train_dflash.py at the reference config, 1 target + 1 drafter
    exec $PY -m torch.distributed.run --standalone --nproc-per-node "$NPROC" train_dflash.py --TARGET="$ASSETS/target" \
        --DATA="$ASSETS/data" --MASK_TOKEN_ID=151669 --TARGET_LAYER_IDS=1,9,17,25,33 --NUM_DRAFT_LAYERS=5 \
        --BLOCK_SIZE=32 --GAMMA=10 --MAX_ANCHORS=1024 --TOKEN_BUDGET=49152 --MAX_BATCH_SIZE=64 --GRAD_ACCUM=4 \
        --TARGET_RANKS="$TARGETS" --MAX_STEPS="$STEPS" --SAVE_EVERY="$SAVE" --KEEP_LAST=1 --LOG_EVERY=1 --OUT_DIR="$RUNS/$1" ${EXTRA:-}
}

nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -l 1 > "$OUT/A_nvidia_smi.csv" 2>/dev/null &
smi=$!
t0=$(date +%s); ( run A ) > "$OUT/A.txt" 2>&1; echo "A: exit $? after $(( $(date +%s) - t0 )) s" >> "$S"
kill $smi 2>/dev/null
awk -F', ' '{ if ($2 > m[$1]) m[$1] = $2 } END { for (g in m) printf "A: GPU %s peak memory.used (nvidia-smi, 1 s samples) %.1f GiB\n", g, m[g] / 1024 }' \
    "$OUT/A_nvidia_smi.csv" >> "$S" 2>/dev/null
grep -E "peak GPU memory|memory per GPU|  (target|drafter) .*GiB peak|throughput per GPU" "$OUT/A.txt" >> "$S"

( run B ) > "$OUT/B.txt" 2>&1 &
job=$!
until grep -q "step=$KILL_AT/" "$OUT/B.txt" 2>/dev/null || ! kill -0 $job 2>/dev/null; do sleep 0.2; done
pid=$(grep -oE "\] rank $KILL_RANK/$NPROC [^ ]+ on .* pid [0-9]+" "$OUT/B.txt" | grep -oE "[0-9]+$" | head -1)
if [[ -n "$pid" ]] && kill -0 $job 2>/dev/null; then
    tk=$(date +%s%N); kill -9 "$pid"; echo "B: kill -9 of rank $KILL_RANK (pid $pid) after the status line of step $KILL_AT" >> "$S"
    for _ in $(seq 1 1200); do kill -0 $job 2>/dev/null || break; sleep 0.1; done
    if kill -0 $job 2>/dev/null; then echo "B: job STILL RUNNING 120 s after the kill" >> "$S"; pkill -9 -f train_dflash.py
    else wait $job; rc=$?; echo "B: job ended with exit $rc $(( ($(date +%s%N) - tk) / 1000000 )) ms after the kill" >> "$S"; fi
    grep -m3 "ABORT" "$OUT/B.txt" >> "$S"
else
    echo "B: did not reach step $KILL_AT (or no pid line)" >> "$S"
fi

t0=$(date +%s); ( run B ) > "$OUT/C.txt" 2>&1     # C: B's OUT_DIR again, RESUME=auto (the default)
echo "C: exit $? after $(( $(date +%s) - t0 )) s; $(grep -m1 RESUMING "$OUT/C.txt")" >> "$S"
cp "$RUNS/A/metrics.jsonl" "$OUT/A_metrics.jsonl" 2>/dev/null
cp "$RUNS/B/metrics.jsonl" "$OUT/C_metrics.jsonl" 2>/dev/null
$PY - "$RUNS" "$STEPS" >> "$S" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
import torch
from trainer import checkpoint as ckpt
runs, steps = Path(sys.argv[1]), int(sys.argv[2])
def rows(name):
    out = {}
    for line in (runs / name / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = r   # B's file holds C's lines too: the later (resumed) line of a step wins
    return out
a, c = rows("A"), rows("B")
for s in sorted(a):
    if s in c:
        print(f"step {s}: loss A {a[s]['loss']:.6f} C {c[s]['loss']:.6f}  acc A {a[s]['acc']:.5f} C {c[s]['acc']:.5f}"
              f"  tok/s A {a[s]['tok_s']:.0f}")
A = ckpt.load_state(ckpt.step_dir(runs / "A" / "checkpoints", steps))
C = ckpt.load_state(ckpt.step_dir(runs / "B" / "checkpoints", steps))
dw = max(float((A["drafter"][k].float() - C["drafter"][k].float()).abs().max()) for k in A["drafter"])
same_w = all(torch.equal(A["drafter"][k], C["drafter"][k]) for k in A["drafter"])
sa, sc = A["optimizer"]["state"], C["optimizer"]["state"]
same_o = all(torch.equal(sa[i][k], sc[i][k]) for i in sa for k in sa[i])
print(f"final step {steps}: drafter weights bitwise equal A vs C: {same_w} (max |diff| {dw:.3g}); "
      f"AdamW state bitwise equal: {same_o}; next_g A {A['next_g']} C {C['next_g']}")
EOF
cat "$S"
