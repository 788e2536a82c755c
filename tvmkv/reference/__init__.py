"""Plain NumPy references (oracles) of the kernels and of the cache. See docs/layout.md."""
