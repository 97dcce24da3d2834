"""Benchmarks: one command per benchmark (`python -m bench.<name>`), each prints a table and
writes JSON under bench/out/. Figures and their machine/date go to bench/RESULTS.md."""
