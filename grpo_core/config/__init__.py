"""The run's typed configuration and what resolves it. JAX-free: the Prefect process imports it.

- `fields`: how a section is declared (`field(default, doc=..., ge=...)`), read and checked
- `model`: the `model` section (ModelSection, LoraConfig) and the architecture (ModelConfig)
- `train`: the `train` section (GRPO objective, sampling, optimizer, rollout engine, mesh)
- `run`: the whole run config (RunConfig: data, rewards, eval, pipeline; stage hashes)
- `presets`: named architectures; `memory`: the memory plan that resolves `auto` settings
- `target`: the TPU a run is checked for and its chips' peaks; `roofline`: the speed bound from them
"""
