"""What users run to measure the engine: bench.py's library (runs, scenarios, workloads, report,
shapes, plot, rl) and the tools beside it: serve (+ serve_client), floor, step_floor, ceilings,
profile_steps, soak, cold_compiles, fp8 (FP8 weights vs bf16), and gpu_figures.sh (the docs'
GPU figures in one script)."""
