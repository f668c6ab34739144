"""Prefect flows and the `grpo` command line (flows/cli.py)."""
