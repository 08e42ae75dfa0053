"""Speed benchmarks; see benchmarks/README.md."""
