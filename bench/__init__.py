"""System benchmarks (`kvsieve bench NAME`) and pytest-benchmark micro-benchmarks."""
