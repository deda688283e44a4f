"""Side-by-side benchmarks (bench_*.py: baseline and ours on the same work, ending with one
`BENCH <name> baseline=.. ours=.. unit=.. ratio=..` line), the GPU checks (gpu_*.py), and the
measuring code they share with the tests (common.py, scaling.py, sample_parity.py). A package,
run from the repository root as `python -m benchmarks.NAME [--quick]`; tests may import it, the
product (mmdata, mmtrain) never does."""
