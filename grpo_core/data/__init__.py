"""Prompt datasets: reading files, folders, the Hub and the synthetic task, and preparing them once
per run. JAX-free."""
