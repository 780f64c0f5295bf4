"""The GPU benchmarks: the figures a CUDA machine owes, and the runs that collect them.

``kvblend bench gpu`` (`figures`: TTFT, decode, peak memory and precompute against
transformers' own forward and ``generate``), decode from the static cache and compiled
(`decode`), a GPU memory tier (`tier`), models of a real model's shape with random weights
(`random_models`), the suite of every step (`suite`) and its summary against the GPU targets
(`suite_summary`); `figures`, `decode` and `suite` run on the CPU too (``--device cpu``). The
phases of the one-command GPU run, which runs ``kvblend bench gpu`` itself, are
`kvblend.bench.gpu_run` (what ``scripts/gpu_run.sh`` runs), above the bench command.
"""
