"""The `train.agent` section: episodes in which the model calls tools, or acts in an environment,
over several turns (agentic GRPO, as TRL's `tools=` / `environment_factory=` and verl's multi-turn
rollout). Empty (no tools, no environment), a run is single-turn and nothing here is in a hash.

    train:
      agent:
        tools: [tools/weather.py:get_weather, calculator]   # built-ins, file.py:fn, module:fn
        environment: envs/wordle.py:Wordle                  # a class: one instance per episode
        environment_kwargs: {max_steps: 6}
        max_turns: 4
        max_tokens: 512                                     # after the prompt: turns, tool results, glue

grpo_core.agent runs the episodes; this module is data only.
"""

from __future__ import annotations

import enum
import typing

from grpo_core.config.fields import Section, Trust, check, field, section


class ToolFormat(enum.Enum):
    """How a model writes a tool call and reads a result (grpo_core.agent.formats)."""

    AUTO = "auto"  # from the tokenizer: its chat template's own format, or `plain` for the built-in characters
    HERMES = "hermes"  # Qwen2.5 / Qwen3 / Hermes: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    LLAMA3 = "llama3"  # Llama 3.1+: the turn is one JSON object {"name": ..., "parameters": {...}}
    PLAIN = "plain"  # the built-in character tokenizer's: a turn `#name args`, a result `>text:`


@section(path="train.agent")
class AgentConfig(Section):
    """Episodes with tools or an environment: the model's turns alternate with tool results until it
    answers without a call, the environment says done, max_turns is reached or max_tokens is spent.
    Only the model's own tokens are trained."""

    tools: tuple[str, ...] = field(
        (),
        doc="Tools the model may call: a built-in's name, path/to/file.py:function or module:function; each "
        "function's type hints and docstring are its schema",
        trust=Trust.CODE,
    )
    environment: str | None = field(
        None,
        doc="An environment class, path/to/file.py:Class or module:Class: one instance per episode, reset(**row) "
        "first (its return, if any, is added to the prompt), its public methods are the episode's tools, an "
        "optional get_reward() a reward, close() at the end",
        trust=Trust.CODE,
    )
    environment_kwargs: dict | None = field(
        None, doc="Keyword arguments each environment instance is built with", trust=Trust.SAFE
    )
    max_turns: int = field(4, doc="Model turns an episode may take at most", ge=1, api_max=64)
    max_tokens: int | None = field(
        None,
        doc="Tokens an episode may hold after its prompt: the model's turns, the tool results and the chat "
        "template's glue (the learner's completion length); empty: train.sampling.max_new_tokens x max_turns",
        ge=2,
        api_max=32_768,
    )
    tool_timeout_s: float = field(
        10.0, doc="Limit on one tool call, seconds; past it the call's result is a timeout error", gt=0
    )
    tool_format: ToolFormat = field(
        ToolFormat.AUTO, doc="How calls are written and results read; auto: the tokenizer's chat template's format"
    )
    max_result_chars: int = field(
        2000, doc="A tool result longer than this is cut (and says so) before it joins the episode", ge=16
    )

    @property
    def enabled(self) -> bool:
        return bool(self.tools) or self.environment is not None

    def episode_tokens(self, max_new_tokens: int) -> int:
        """The tokens an episode holds after its prompt at most: the learner's completion length."""
        return self.max_tokens if self.max_tokens is not None else max_new_tokens * self.max_turns

    def validate(self) -> None:
        check(
            all(isinstance(t, str) and t for t in self.tools),
            f"train.agent.tools must be names or 'path/to/file.py:function' specs, got {list(self.tools)!r}",
        )
        check(
            len(set(self.tools)) == len(self.tools),
            f"train.agent.tools names a tool twice: {list(self.tools)!r}",
        )
        check(
            self.environment_kwargs is None or self.environment is not None,
            "train.agent.environment_kwargs is set but train.agent.environment is empty",
        )
        check(
            self.environment is None or (isinstance(self.environment, str) and bool(self.environment.strip())),
            f"train.agent.environment must be a built-in's name, 'path/to/file.py:Class' or 'module:Class', got "
            f"{self.environment!r}",
        )

    def hash_fields(self) -> dict[str, typing.Any] | None:
        """What changes a result, or None for a single-turn run (its hashes stay as they were)."""
        if not self.enabled:
            return None
        out = self.to_dict()
        del out["tool_timeout_s"]  # a time limit: a tool that returns in time gives the same result
        return out
