"""How a model writes a tool call, and how a tool's result joins the episode, per chat template.

- hermes (Qwen2.5, Qwen3, Hermes): calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks in the assistant's turn, any number, text around them the turn's content.
- llama3 (Llama 3.1+): the turn is one JSON object `{"name": ..., "parameters": {...}}`, possibly after
  `<|python_tag|>`.
- plain (the built-in character tokenizer, which has no chat template): a turn that ends with `#` is a
  call, `name arg ... #` (the name may be left out where the episode has one tool): `#` ends the
  turn as the end-of-text token does; a result reads `>text:`.

A result joins as the template renders a tool message after an assistant turn: the tokens the chat
template writes for `[tool messages]` after a turn that ended at its end-of-turn token, up to the
next assistant turn's header (as TRL computes them, from a small conversation rendered with and
without the tool messages). The episode's token ids are never re-tokenized: what the model
generated is kept as generated.

Which format a run uses: train.agent.tool_format, or auto: read off the tokenizer's chat template.
A template whose format is not one of these is refused (`grpo check` says so, naming it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from grpo_core.config.agent import ToolFormat
from grpo_core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Call:
    """One call as the model wrote it: arguments None and `problem` set when it could not be read."""

    name: str
    arguments: dict[str, Any] | None
    problem: str | None = None


def detect(tokenizer, asked: ToolFormat = ToolFormat.AUTO, where: str = "model.tokenizer") -> ToolFormat:
    """The format a run's episodes use: `asked`, or from the tokenizer's chat template (auto); a
    template with no tool-call format this module reads is refused, naming the template."""
    template = _template(tokenizer)
    if asked is not ToolFormat.AUTO:
        if asked is not ToolFormat.PLAIN and template is None:
            raise ConfigError(
                f"train.agent.tool_format={asked.value} renders results through the chat template, and {where} has "
                "none: use a tokenizer with a chat template, or tool_format: plain"
            )
        return asked
    if template is None:
        if _is_hf(tokenizer):
            raise ConfigError(
                f"train.agent: {where} has no chat template, so no tool-call format to read: use a tokenizer whose "
                "template renders tools (Qwen2.5, Qwen3, Llama 3.1+), or set train.agent.tool_format"
            )
        return ToolFormat.PLAIN
    if "<tool_call>" in template:
        return ToolFormat.HERMES
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFormat.LLAMA3
    first = template.strip().splitlines()[0][:80] if template.strip() else ""
    raise ConfigError(
        f"train.agent: the chat template of {where} has no tool-call format this project reads (it writes no "
        f"<tool_call> block, as Qwen2.5/Qwen3/Hermes templates do, nor Llama 3's <|python_tag|>/ipython): "
        f"template starting {first!r}. Use a model whose template renders tools, or set train.agent.tool_format "
        "(hermes, llama3) if you know how it writes calls"
    )


def _is_hf(tokenizer) -> bool:
    return hasattr(tokenizer, "apply_chat_template")


def _template(tokenizer) -> str | None:
    inner = getattr(tokenizer, "tok", tokenizer)
    t = getattr(inner, "chat_template", None)
    if isinstance(t, dict):  # several named templates: the one for tools, else the default
        t = t.get("tool_use") or t.get("default")
    return t if isinstance(t, str) and t.strip() else None


# -- reading calls ------------------------------------------------------------------------------

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _arguments(obj: dict[str, Any], *keys: str) -> tuple[dict[str, Any] | None, str | None]:
    for k in keys:
        if k in obj:
            args = obj[k]
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as exc:
                    return None, f"the arguments are not JSON ({exc.msg})"
            if not isinstance(args, dict):
                return None, f"the arguments must be a JSON object, got {type(args).__name__}"
            return args, None
    return {}, None


def _json_call(text: str, keys: tuple[str, ...]) -> Call:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return Call("?", None, f"the call is not JSON ({exc.msg} at character {exc.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call("?", None, 'a call must be a JSON object with a "name"')
    args, problem = _arguments(obj, *keys)
    return Call(obj["name"], args, problem)


def parse(fmt: ToolFormat, text: str, tool_names: Sequence[str]) -> tuple[str, list[Call]]:
    """(the turn's content without its calls, the calls) of one assistant turn's text."""
    if fmt is ToolFormat.HERMES:
        calls = [_json_call(m.group(1), ("arguments", "parameters")) for m in _HERMES.finditer(text)]
        return _HERMES.sub("", text).strip(), calls
    if fmt is ToolFormat.LLAMA3:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{") and '"name"' in body:
            return "", [_json_call(body, ("parameters", "arguments"))]
        return text.strip(), []
    if fmt is ToolFormat.PLAIN:
        body = text.strip()
        if not body.endswith(CALL_MARK):
            return body, []
        words = body[: -len(CALL_MARK)].split()
        if words and words[0] in tool_names:
            name, args = words[0], words[1:]
        elif len(tool_names) == 1:
            name, args = tool_names[0], words
        else:
            return "", [Call(words[0] if words else "?", None, f"no tool {words[0] if words else ''!r}")]
        return "", [Call(name, {f"_{i}": a for i, a in enumerate(args)})]  # positional: mapped by plain_arguments
    raise ValueError(f"unknown tool format {fmt}")


CALL_MARK = "#"  # the plain format's call: it ends the model's turn


def call_stops(fmt: ToolFormat, tokenizer) -> tuple[int, ...]:
    """Tokens that end a model's turn beside the tokenizer's own stop tokens: the plain format's
    call mark (a template's call ends its turn at the end-of-turn token)."""
    return tuple(tokenizer.encode(CALL_MARK)) if fmt is ToolFormat.PLAIN else ()


def plain_arguments(params: Sequence[str], given: dict[str, Any]) -> dict[str, Any]:
    """The plain format's positional words as the tool's keyword arguments (TypeError: too many)."""
    words = [given[k] for k in sorted(given, key=lambda k: int(k[1:]))] if all(k.startswith("_") for k in given) else []
    if not words:
        return given
    if len(words) > len(params):
        raise TypeError(f"takes {len(params)} argument(s) ({', '.join(params) or 'none'}), got {len(words)}")
    return dict(zip(params, words))


def call_message(calls: Sequence[Call]) -> list[dict[str, Any]]:
    """The assistant message's tool_calls, as chat templates and TRL's reward functions read them."""
    return [{"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}} for c in calls]


# -- writing results ----------------------------------------------------------------------------


class Renderer:
    """The tokens a turn's tool results add to an episode, for one tokenizer and format."""

    def __init__(self, tokenizer, fmt: ToolFormat):
        self.tokenizer, self.fmt = tokenizer, fmt
        self._inner = getattr(tokenizer, "tok", tokenizer)

    def result_ids(self, results: Sequence[dict[str, Any]]) -> list[int]:
        """Tokens of the tool messages `results` ({"role": "tool", "name", "content"}) after an
        assistant turn that ended at its end-of-turn token, through the next turn's header."""
        if self.fmt is ToolFormat.PLAIN:
            return self.tokenizer.encode("".join(f">{_fit(self.tokenizer, r['content'])}:" for r in results))
        return _suffix_ids(self._inner, list(results), getattr(self.tokenizer, "stop_ids", None))

    def text(self, ids: Sequence[int], ended: bool) -> str:
        """A turn's text as generated, special tokens kept (a template's call markers may be one),
        without the end-of-turn token where it `ended` (the plain format's call mark is kept)."""
        if self.fmt is ToolFormat.PLAIN:
            return self.tokenizer.decode(ids)  # the end-of-text token decodes to nothing
        return self._inner.decode(list(ids[:-1] if ended else ids), skip_special_tokens=False)


def _fit(tokenizer, text: str) -> str:
    """`text` in what the built-in character tokenizer encodes: lower case, the rest as '?'."""
    chars = getattr(tokenizer, "stoi", None)
    if chars is None:
        return text
    low = text.lower()
    return "".join(c if c in chars else "?" for c in low)


def _suffix_ids(tok, results: list[dict[str, Any]], stop_ids) -> list[int]:
    """The chat template's tokens for `results` after an assistant turn with a call, to the next
    turn's header: rendered after a small conversation and with it, the difference."""
    name = results[0].get("name", "tool")
    call = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": call}]
    prefix = list(tok.apply_chat_template(base, tokenize=True, add_generation_prompt=False, return_dict=False))
    full = list(tok.apply_chat_template(base + results, tokenize=True, add_generation_prompt=True, return_dict=False))
    # templates that write "<|im_end|>\n" after a turn: the model stops at the end-of-turn token,
    # so the result starts right after it (the newline is the result's)
    stops = set(stop_ids or []) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())
    ends = [i for i, t in enumerate(prefix) if t in stops]
    if ends:
        prefix = prefix[: ends[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ConfigError(
            "train.agent: the chat template renders a conversation with a tool result differently from the same "
            "conversation without it (not a prefix), so results cannot be added to an episode token by token"
        )
    return full[len(prefix) :]
