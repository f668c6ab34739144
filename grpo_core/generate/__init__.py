"""Generation: the built-in sampler (jitted prefill and decode over the model's KV cache) and the
rows a rollout draws. Below both the rollout engines and the trainer: it knows neither."""
