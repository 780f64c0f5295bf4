"""The GPU benchmarks: the figures a CUDA machine owes, and the runs that collect them.

``kvblend bench gpu`` (`figures`: TTFT, decode, peak memory and precompute against
transformers' own forward and ``generate``), decode from the static cache and compiled
(`decode`), a GPU memory tier (`tier`), models of a real model's shape with random weights
(`random_models`), the suite of every step (`suite`) and its summary against the GPU targets
(`suite_summary`), and the phases of the one-command GPU run (`run`, what
``scripts/gpu_run.sh`` runs); `figures`, `decode`, `suite` and `run` run on the CPU too
(``--device cpu``).
"""
