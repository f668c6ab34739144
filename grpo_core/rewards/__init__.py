"""Reward functions: the built-ins, loading a user's `file.py:fn` or `module:fn`, and scoring a batch. JAX-free."""
