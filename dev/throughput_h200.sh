#!/usr/bin/env bash
# Today's throughput measurement (BENCHMARKS.md) on the GPUs present, random Qwen3-8B shapes, each
# step's output under OUT. Each step fits one 10-minute device call on one H200; ONLY picks steps, in this order:
#   tests     the GPU tests: CE kernel, flex (incl. the fallback BlockMask), compiled drafter, overlapped AdamW,
#             the export's AutoModel load, and with 2 GPUs the NCCL trainer test
#   drafter   the drafter step, 40 steps, compiled layers, at 512 and at 2,048 blocks per 4 x 3072 (42 and 167
#             blocks per 1K tokens: this project's default and SpecForge's density)
#   dflash2   the same drafter step with a DFlash2 drafter (--arch dflash2 at train_dflash's CONV_* / SELECTOR_*):
#             step time and peak beside drafter's, same shape, same flags
#   target    the target feature forward, compiled, 4 x 3072
#   fp8       bench/fp8_h200.py: bf16 and FP8 peaks, TARGET_FP8 / DRAFTER_FP8, the one-process trainer at 2,048
#             blocks with COMPILE_TARGET
#   trainer   train_dflash.py at the benchmark shape (dev/trainer_h200.sh: one process on one GPU, 1 + N-1 on N)
#   ONLY="drafter dflash2" bash dev/throughput_h200.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/throughput}
PY=${PY:-python3}
ONLY=${ONLY:-tests drafter dflash2 target fp8 trainer}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=1
mkdir -p "$OUT"
NGPU=$(nvidia-smi -L | wc -l)
for step in $ONLY; do
    echo "== $step ($(date -u +%H:%M:%S))"
    case $step in
        tests)   $PY -m pytest -q -rs tests/gpu/test_ce_kernel_cuda.py tests/gpu/test_flex_cuda.py \
                     tests/gpu/test_optim_cuda.py tests/unit/test_export.py tests/unit/test_compile.py \
                     tests/gpu/test_fastdecode_cuda.py \
                     "tests/unit/test_engine.py::test_compiled_sampler_draws_what_the_eager_one_draws" \
                     $( (( NGPU >= 2 )) && echo tests/gpu/test_train_cuda.py) -m "slow or not slow" \
                     2>&1 | tee "$OUT/tests.txt" | tail -15 ;;
        drafter) for a in 512 2048; do
                     $PY -m bench.bench_dflash --mode drafter --compile-drafter layers --steps 40 --anchors $a \
                         --json "$OUT/drafter_$a.json" 2>&1 | tee "$OUT/drafter_$a.txt" | grep -v "Loading weights" | tail -12
                 done ;;
        dflash2) for a in 512 2048; do
                     $PY -m bench.bench_dflash --mode drafter --arch dflash2 --compile-drafter layers --steps 40 \
                         --anchors $a --json "$OUT/drafter_dflash2_$a.json" 2>&1 | \
                         tee "$OUT/drafter_dflash2_$a.txt" | grep -v "Loading weights" | tail -12
                 done ;;
        target)  $PY -m bench.bench_dflash --mode target --compile --json "$OUT/target.json" 2>&1 | \
                     tee "$OUT/target.txt" | grep -v "Loading weights" | tail -8 ;;
        fp8)     $PY -m bench.fp8_h200 --json "$OUT/fp8.json" 2>&1 | tee "$OUT/fp8.txt" | tail -30 ;;
        trainer) MODES=layers bash dev/trainer_h200.sh "${ASSETS:-runs/bench_assets}" "$OUT/trainer" 2>&1 | \
                     tee "$OUT/trainer.txt" | grep "step=\|done\|error" | tail -8 ;;
        *) echo "unknown step $step (tests drafter dflash2 target fp8 trainer)"; exit 2 ;;
    esac
done
