"""GPU benchmark (bench_dflash) and the per-role memory planner (planner)."""
