"""Benchmarks run by ``moetrain bench NAME``: one module per benchmark (see moetrain/commands/bench.py)."""
