"""The GPU benchmarks: the trainer's parts at real shapes (bench_dflash), the generation engine (generate_bench) and
the FP8 switches (fp8_h200). baselines/ holds the reference figures of BENCHMARKS.md per machine kind, as JSON."""
