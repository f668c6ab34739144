"""Benchmarks: python -m bench.grpo_step."""
