"""The process entry points each pipeline stage runs (python -m grpo_core.stages.worker / .readiness). Needs JAX."""
