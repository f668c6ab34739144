"""The built-in engine: grpo_core.generate.sampler on the learner's own parameters and devices.

Nothing to sync: each call reads the current parameters through `params_fn`, so the compiled
prefill/decode programs see every update (and no second copy of the weights exists). This is
the engine that works on multi-host slices: every host runs the same compiled program on the
same host arrays. With a `placement` (grpo_core.runtime.mesh) the prompts and the KV cache are laid
out over the rollout mesh, the weights too where that mesh is not the learner's, and the
completions come back whole to every process.
"""

from __future__ import annotations

from grpo_core.generate.sampler import SamplerOptions, compile_jobs, generate
from grpo_core.generate.types import Completions
from grpo_core.runtime.mesh import to_host


class JaxEngine:
    name = "jax"

    def __init__(self, graphdef, params_fn, opts: SamplerOptions, placement=None):
        self.graphdef, self.params_fn, self.opts, self.placement = graphdef, params_fn, opts, placement
        self.synced_step: int | None = None

    def _inputs(self, prompt_tokens, prompt_valid):
        """(params, prompt_tokens, prompt_valid, mesh) as the compiled sampler takes them."""
        pl = self.placement
        if pl is None:
            return self.params_fn(), prompt_tokens, prompt_valid, None
        return (
            pl.rollout_params(self.params_fn()),
            *pl.put_batch((prompt_tokens, prompt_valid), pl.rollout),
            pl.rollout,
        )

    def compile_jobs(self, prompt_tokens, prompt_valid, key, num_samples: int):
        params, ptok, pval, mesh = self._inputs(prompt_tokens, prompt_valid)
        return compile_jobs(self.graphdef, params, ptok, pval, key, self.opts, num_samples, mesh)

    def generate(self, prompt_tokens, prompt_valid, key, num_samples: int) -> Completions:
        params, ptok, pval, mesh = self._inputs(prompt_tokens, prompt_valid)
        return to_host(generate(self.graphdef, params, ptok, pval, key, self.opts, num_samples, mesh))  # host sync

    def sync(self, params, step: int) -> float:
        self.synced_step = step  # the sampler reads params_fn() at each call: nothing to copy
        return 0.0

    def close(self) -> None:
        pass
