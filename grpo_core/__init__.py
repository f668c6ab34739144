"""grpo_core: GRPO in JAX + Flax NNX + Optax. Never imports Prefect."""
