"""relay-trio benchmark harness: `python -m bench` (or `bench/run`). See bench/README in the
project README's "Benchmarks" section and bench/RESULTS.md for the latest numbers."""
