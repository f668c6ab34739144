"""The built-in sampler, which lives in grpo_core.generate.sampler (below the engines and the
trainer); its names stay importable from here."""

from grpo_core.generate.sampler import *  # noqa: F401,F403
