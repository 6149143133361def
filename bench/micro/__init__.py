"""pytest-benchmark micro-benchmarks of the hot paths (see docs/performance.md, "Micro-benchmarks").

Run with `pytest bench/micro --benchmark-only`; the default test run (testpaths = tests)
never collects them.
"""
