"""Benchmarks (commands, not tests): each writes a table and optionally JSON."""
