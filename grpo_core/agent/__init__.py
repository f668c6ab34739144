"""Agentic GRPO: episodes in which the model calls tools, or acts in an environment, over several
turns (train.agent). tools: what the model may call and how a call runs; formats: how a template
writes calls and results; episodes: the turns of a batch over any rollout engine; builtin: the
built-in tools and the environment of the synthetic task that needs one. tools, formats and builtin
are JAX-free (`grpo check` reads them); episodes runs in the workers, beside the engine."""
