"""A batch of episodes over any rollout engine: the model's turns alternate with tool results.

Each of the B = P x G rows is an episode. Its first turn is the single-turn rollout itself (the
same prompts, key and call, so the first turn draws what a single-turn run would). After a turn
with calls, the calls run (grpo_core.agent.tools), their results join the episode as the chat
template renders them (grpo_core.agent.formats), and the next turn continues from the whole
conversation: the prompt and every token so far, re-read in one prefill (the rows in one batch of
a stable shape, every row, so each turn's program is compiled once per prompt bucket). An episode
ends when the model answers without a call, its environment says `done`, max_turns turns were
taken, or its max_tokens are spent: then it is truncated (a turn cut short, or a result that no
longer fits, which is left out as TRL leaves it out), which the metrics count and
train.grpo.mask_truncated_completions can mask out of the loss, as DAPO's overlong filter does.

What the learner receives is a completion of N = max_tokens tokens per row, `trained` marking the
model's own tokens: the tool results and the template's glue are context, never trained (no loss,
no KL, no log-prob ratio: their mask is 0 wherever the mask is read).

Resume: each turn's key is fold_in(step key, turn), and a deterministic tool returns the same result
on the same call, so a step run again after a kill draws the same episodes, byte for byte. A tool
whose result changes between calls (a clock, a web search) makes the re-run step another episode:
the run resumes and stays correct, but not the same bytes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from grpo_core.agent import formats
from grpo_core.agent.tools import CallResult, Toolbox, close_env, run_episode_calls
from grpo_core.config.agent import AgentConfig, ToolFormat
from grpo_core.errors import ConfigError
from grpo_core.generate.sampler import pad_prompts
from grpo_core.generate.types import Completions

# (prompt tokens, prompt valid, key, samples per prompt) -> host Completions: an engine's generate
Generate = Callable[[np.ndarray, np.ndarray, Any, int], Completions]


@dataclasses.dataclass
class Episodes:
    """A batch of finished episodes, on the host."""

    completions: Completions  # (B, N): the episodes' tokens after the prompt, `trained` set
    messages: list[list[dict[str, Any]]]  # each episode after its prompt: assistant and tool messages
    finals: list[str]  # each episode's last assistant content: what the built-in rewards score
    calls: list[list[CallResult]]
    turns: np.ndarray  # (B,) model turns taken
    envs: list[Any]  # the environment instances, open until close()
    tool_seconds: float  # wall time the tool calls took, all rows together

    def tool_calls(self) -> list[list[dict[str, Any]]]:
        """Each episode's calls as reward functions read them (the `tool_calls` keyword)."""
        return [
            [{"name": c.name, "arguments": c.arguments, "result": c.content, "error": c.error} for c in calls]
            for calls in self.calls
        ]

    def metrics(self, tool_names: Sequence[str] = ()) -> dict[str, float]:
        """The episodes' per-step figures: turns, calls and errors per episode, truncated ones, tool time,
        and each tool's calls."""
        b = max(1, len(self.calls))
        out = {
            "turns_per_episode": float(np.mean(self.turns)) if len(self.turns) else 0.0,
            "tool_calls_per_episode": sum(len(c) for c in self.calls) / b,
            "tool_errors_per_episode": sum(x.error for c in self.calls for x in c) / b,
            "episodes/truncated_ratio": float(np.mean(self.completions.truncated)) if len(self.calls) else 0.0,
            "time/tools": self.tool_seconds,
        }
        for name in tool_names:
            out[f"tools/{name}/calls"] = sum(x.name == name for c in self.calls for x in c) / b
        return out

    def close(self) -> None:
        for env in self.envs:
            if env is not None:
                close_env(env)
        self.envs = [None] * len(self.envs)


@dataclasses.dataclass(frozen=True)
class Turns:
    """What an episode's turns need that is not the model: the run's settings, tokens and tools."""

    agent: AgentConfig
    fmt: ToolFormat
    renderer: formats.Renderer
    toolbox: Toolbox
    eos_ids: tuple[int, ...]  # what ends a model's turn: the tokenizer's stops, and the format's call mark
    pad_id: int
    buckets: tuple[int, ...]
    budget: int  # N: an episode's tokens after its prompt

    @classmethod
    def of(cls, agent: AgentConfig, tokenizer, toolbox: Toolbox, eos_ids, pad_id: int, buckets, max_new_tokens: int):
        fmt = formats.detect(tokenizer, agent.tool_format)
        return cls(
            agent,
            fmt,
            formats.Renderer(tokenizer, fmt),
            toolbox,
            tuple(dict.fromkeys([*(int(e) for e in eos_ids), *formats.call_stops(fmt, tokenizer)])),
            int(pad_id),
            tuple(buckets),
            agent.episode_tokens(max_new_tokens),
        )


def _reset_row(row: dict[str, Any]) -> dict[str, Any]:
    """The row as an environment's reset(**row) receives it: its columns, the prompt as the data
    gave it (chat messages where it held them), as TRL passes the dataset's example."""
    out = {k: v for k, v in row.items() if k not in ("prompt_ids", "prompt_messages")}
    if row.get("prompt_messages"):
        out["prompt"] = row["prompt_messages"]
    return out


def run(
    generate: Generate,
    turns: Turns,
    rows: Sequence[dict[str, Any]],
    prompt_tokens: np.ndarray,
    prompt_valid: np.ndarray,
    key,
    num_samples: int,
    prompt_with: Callable[[dict[str, Any], str], list[int]] | None = None,
) -> tuple[Episodes, np.ndarray, np.ndarray]:
    """Episodes of `rows` (P prompts, `num_samples` episodes each). -> (episodes, the prompts as
    the episodes saw them: (P, Tp') tokens and valid, which an environment's first observation may
    have changed). `prompt_with(row, observation)`: a row's prompt tokens with an environment's
    first observation added (the data's own rendering)."""
    g, p = num_samples, len(rows)
    b, n, agent = p * g, turns.budget, turns.agent
    envs = [turns.toolbox.new_env() for _ in range(b)]
    try:
        prompt_tokens, prompt_valid = _observe(turns, envs, rows, g, prompt_tokens, prompt_valid, prompt_with)
        tools = [turns.toolbox.episode(env) for env in envs]
    except BaseException:
        for env in envs:
            if env is not None:
                close_env(env)
        raise
    prompts = [np.asarray(t)[np.asarray(v, bool)].tolist() for t, v in zip(prompt_tokens, prompt_valid)]
    toks: list[list[int]] = [[] for _ in range(b)]
    mine: list[list[bool]] = [[] for _ in range(b)]
    lps: list[list[float]] = [[] for _ in range(b)]
    messages: list[list[dict[str, Any]]] = [[] for _ in range(b)]
    calls: list[list[CallResult]] = [[] for _ in range(b)]
    finals = [""] * b
    taken = np.zeros(b, np.int32)
    cut = np.zeros(b, bool)
    active = [True] * b
    tool_s = 0.0
    stops = set(turns.eos_ids)
    for turn in range(agent.max_turns):
        if not any(active):
            break
        if turn == 0:  # the single-turn rollout's own call: the same prompts, key and samples
            out = generate(prompt_tokens, prompt_valid, key, g)
        else:  # every row (a stable shape), the whole conversation re-read in one prefill
            seqs = [prompts[i // g] + toks[i] for i in range(b)]
            ptok, pval = pad_prompts(seqs, turns.buckets, turns.pad_id)
            out = generate(ptok, pval, jax.random.fold_in(key, turn), 1)
        pending: list[list[tuple]] = [[] for _ in range(b)]
        for i in range(b):
            if not active[i]:
                continue
            length = int(out.lengths[i])
            ids = [int(t) for t in out.tokens[i, :length]]
            lp = [float(x) for x in out.logprobs[i, :length]]
            room = n - len(toks[i])
            over = length > room
            if over:
                ids, lp = ids[:room], lp[:room]
            toks[i] += ids
            mine[i] += [True] * len(ids)
            lps[i] += lp
            taken[i] += 1
            ended = bool(ids) and ids[-1] in stops and not over
            text = turns.renderer.text(ids, ended)
            names = list(tools[i])
            content, found = formats.parse(turns.fmt, text, names) if ended else (text, [])
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if found:
                message["tool_calls"] = formats.call_message(found)
            messages[i].append(message)
            finals[i] = content
            if not ended:  # cut at max_new_tokens or at the episode's budget
                cut[i], active[i] = True, False
            elif not found:  # an answer: the episode is done
                active[i] = False
            elif turn == agent.max_turns - 1:  # a call it has no turn left to read
                cut[i], active[i] = True, False
            else:
                pending[i] = [_resolve(c, tools[i], turns.fmt) for c in found]
        if not any(pending):
            continue
        t0 = time.perf_counter()
        results = run_episode_calls(pending, agent.tool_timeout_s, agent.max_result_chars)
        tool_s += time.perf_counter() - t0
        for i, res in enumerate(results):
            if not pending[i]:
                continue
            said = [{"role": "tool", "name": r.name, "content": r.content} for r in res]
            glue = turns.renderer.result_ids(said)
            calls[i] += res
            if len(toks[i]) + len(glue) >= n:  # no room for the result and a turn after it: left out
                cut[i], active[i] = True, False
                continue
            toks[i] += glue
            mine[i] += [False] * len(glue)
            lps[i] += [0.0] * len(glue)
            messages[i] += said
            if envs[i] is not None and getattr(envs[i], "done", False):  # the environment ended the episode
                active[i] = False
    completions = _pack(toks, mine, lps, cut, n, turns.pad_id)
    episodes = Episodes(completions, messages, finals, calls, taken, envs, tool_s)
    return episodes, prompt_tokens, prompt_valid


def reward_columns(eps: Episodes) -> dict[str, list[Any]]:
    """What reward functions that name them receive beside the dataset's columns: each episode's
    tool calls, and with an environment its instance (TRL's `environments`)."""
    out: dict[str, list[Any]] = {"tool_calls": eps.tool_calls()}
    if any(env is not None for env in eps.envs):
        out["environments"] = list(eps.envs)
    return out


def prompt_with(tokenizer, row: dict[str, Any], observation: str) -> list[int]:
    """A row's prompt tokens with an environment's first observation added, as TRL adds it: to the
    last user message of chat rows (rendered again through the chat template), else to the text."""
    messages = row.get("prompt_messages")
    if messages:
        last = messages[-1]
        messages = [*messages[:-1], {**last, "content": f"{last.get('content') or ''}{observation}"}]
        return tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return tokenizer.encode(f"{row.get('prompt', '')}{observation}")


def _resolve(call: formats.Call, tools: dict[str, Any], fmt: ToolFormat) -> tuple:
    """(tool or None, name, arguments, problem) of one parsed call, for tools.run_calls."""
    tool = tools.get(call.name)
    if call.problem is not None or tool is None:
        return tool, call.name, call.arguments, call.problem
    args = call.arguments or {}
    if fmt is ToolFormat.PLAIN:
        try:
            args = formats.plain_arguments(tool.parameters, args)
        except TypeError as exc:
            return tool, call.name, None, f"{call.name}() {exc}"
    return tool, call.name, args, None


def _observe(turns: Turns, envs, rows, g: int, prompt_tokens, prompt_valid, prompt_with):
    """reset(**row) of each episode's environment; where it returns text, each prompt rendered
    again with it (the G episodes of a prompt must see the same prompt: GRPO compares them)."""
    if turns.toolbox.env_class is None:
        return prompt_tokens, prompt_valid
    seen: list[Any] = []
    for i, env in enumerate(envs):
        obs = env.reset(**_reset_row(rows[i // g]))
        seen.append(obs if isinstance(obs, str) and obs else None)
    if not any(seen):
        return prompt_tokens, prompt_valid
    for j in range(len(rows)):
        group = seen[j * g : (j + 1) * g]
        if len(set(group)) > 1:
            raise ConfigError(
                f"train.agent.environment: {type(envs[j * g]).__name__}.reset returned different observations for the "
                f"{g} episodes of one prompt (row {j}): GRPO compares a prompt's episodes with each other, so reset "
                "must return the same first observation for the same row (seed any randomness from the row)"
            )
    if prompt_with is None:
        raise ConfigError("train.agent.environment: reset returned an observation, which this rollout cannot add")
    ids = [prompt_with(rows[j], seen[j * g]) if seen[j * g] else None for j in range(len(rows))]
    plain = [np.asarray(t)[np.asarray(v, bool)].tolist() for t, v in zip(prompt_tokens, prompt_valid)]
    return pad_prompts([x if x is not None else plain[j] for j, x in enumerate(ids)], turns.buckets, turns.pad_id)


def _pack(toks, mine, lps, cut, n: int, pad_id: int) -> Completions:
    b = len(toks)
    tokens = np.full((b, n), pad_id, np.int32)
    trained = np.zeros((b, n), bool)
    logprobs = np.zeros((b, n), np.float32)
    lengths = np.zeros(b, np.int32)
    for i in range(b):
        k = len(toks[i])
        tokens[i, :k], trained[i, :k], logprobs[i, :k], lengths[i] = toks[i], mine[i], lps[i], k
    return Completions(tokens=tokens, logprobs=logprobs, lengths=lengths, truncated=np.asarray(cut), trained=trained)
