"""The ``kvblend`` command line: demo, precompute, ask, explain, store, bench (`main`)."""
