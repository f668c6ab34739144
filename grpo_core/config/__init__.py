"""The run's typed configuration and what resolves it (presets, the memory plan). JAX-free: the Prefect process imports it."""
