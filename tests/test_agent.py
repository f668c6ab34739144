"""Agentic GRPO's parts (grpo_core.agent): tool calls read in each supported format, results rendered
through real chat templates, tools that raise, hang or are called wrongly, episodes cut at their
budget, environments with state (a TRL-style class among them), and the loss mask: the tokens an
episode did not generate get no gradient. The policy in the episode tests is a scripted engine (it
plays fixed turns through the engines' own interface): what is tested is the protocol around the
model, which a random tiny model would not exercise. A whole run on the synthetic tool task learns
to call its tool in tests/test_agent_run.py."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_core.agent import episodes, formats
from grpo_core.agent.builtin import Codebook, calculator
from grpo_core.agent.tools import Tool, Toolbox, load_toolbox, run_calls, schema_of, tools_of
from grpo_core.config.agent import AgentConfig, ToolFormat
from grpo_core.data.synthetic import CharTokenizer
from grpo_core.errors import ConfigError
from grpo_core.generate.types import Completions
from grpo_core.nn.tiny_hf import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, save_bpe_tokenizer

# -- formats ------------------------------------------------------------------------------------


def test_hermes_calls_as_qwen_writes_them():
    text = (
        'Let me add.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
        '<tool_call>{"name": "lookup", "arguments": "{\\"key\\": \\"a\\"}"}</tool_call>'
    )
    content, calls = formats.parse(ToolFormat.HERMES, text, ["calculator", "lookup"])
    assert content == "Let me add."
    assert calls == [formats.Call("calculator", {"expression": "2+3"}), formats.Call("lookup", {"key": "a"})]
    _, [bad] = formats.parse(ToolFormat.HERMES, "<tool_call>{name: calculator}</tool_call>", ["calculator"])
    assert bad.arguments is None and bad.problem.startswith("the call is not JSON")
    _, [nameless] = formats.parse(ToolFormat.HERMES, '<tool_call>{"arguments": {}}</tool_call>', [])
    assert nameless.problem == 'a call must be a JSON object with a "name"'
    _, [cut] = formats.parse(ToolFormat.HERMES, '<tool_call>{"name": "calculator", "arguments": {"ex', ["calculator"])
    assert cut.problem is not None  # a call the turn's budget cut off: an error the model reads
    assert formats.parse(ToolFormat.HERMES, "It is 5.", ["calculator"]) == ("It is 5.", [])


def test_llama3_calls_as_llama_writes_them():
    text = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}'
    assert formats.parse(ToolFormat.LLAMA3, text, ["calculator"]) == (
        "",
        [formats.Call("calculator", {"expression": "6*7"})],
    )
    assert formats.parse(ToolFormat.LLAMA3, '{"name": "calculator", "arguments": {}}', [])[1][0].arguments == {}
    assert formats.parse(ToolFormat.LLAMA3, "The answer is 42.", ["calculator"]) == ("The answer is 42.", [])


def test_plain_calls_end_the_turn_with_the_mark():
    one = ["code"]
    assert formats.parse(ToolFormat.PLAIN, "#", one) == ("", [formats.Call("code", {})])
    assert formats.parse(ToolFormat.PLAIN, "417", one) == ("417", [])
    two = ["calculator", "code"]
    assert formats.parse(ToolFormat.PLAIN, "calculator 2+3#", two)[1] == [formats.Call("calculator", {"_0": "2+3"})]
    _, [unknown] = formats.parse(ToolFormat.PLAIN, "nope 1#", two)
    assert unknown.problem == "no tool 'nope'"
    assert formats.plain_arguments(["expression"], {"_0": "2+3"}) == {"expression": "2+3"}
    with pytest.raises(TypeError, match=r"takes 0 argument\(s\) \(none\), got 1"):
        formats.plain_arguments([], {"_0": "x"})


def _llama_template() -> str:
    """A small Llama 3.1-style template: a call is the assistant turn's JSON after <|python_tag|>,
    a result an ipython turn."""
    return (
        "{% for m in messages %}<|im_start|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}\n"
        "{% if m['tool_calls'] is defined and m['tool_calls'] %}<|python_tag|>"
        "{{ {'name': m['tool_calls'][0]['function']['name'], 'parameters': m['tool_calls'][0]['function']['arguments']}"
        " | tojson }}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory):
    """`grpo tiny-model`'s tokenizer: byte-level BPE with Qwen's chat template and tools."""
    from grpo_core.store.sources import HFTokenizer

    folder = tmp_path_factory.mktemp("qwen-tok")
    save_bpe_tokenizer(folder, template=TOOLS_CHAT_TEMPLATE)
    return HFTokenizer(str(folder))


def test_the_format_is_read_off_the_template_and_an_unknown_one_refused(qwen_tokenizer, tmp_path):
    assert formats.detect(qwen_tokenizer) is ToolFormat.HERMES
    assert formats.detect(CharTokenizer()) is ToolFormat.PLAIN
    qwen_tokenizer.tok.chat_template = _llama_template()
    try:
        assert formats.detect(qwen_tokenizer) is ToolFormat.LLAMA3
        qwen_tokenizer.tok.chat_template = CHAT_TEMPLATE  # renders no tools
        with pytest.raises(ConfigError) as err:
            formats.detect(qwen_tokenizer)
        assert "has no tool-call format this project reads" in str(err.value)
        assert 'template starting "{% for m in messages %}<|im_start|>' in str(err.value)
        assert formats.detect(qwen_tokenizer, ToolFormat.HERMES) is ToolFormat.HERMES  # the user says so
    finally:
        qwen_tokenizer.tok.chat_template = TOOLS_CHAT_TEMPLATE


def test_results_join_as_the_template_renders_them(qwen_tokenizer):
    """The tokens a result adds are the template's: after the model's <|im_end|>, a user turn of
    <tool_response> blocks, then the next assistant header; the same tokens as rendering the whole
    conversation, so nothing is re-tokenized differently."""
    r = formats.Renderer(qwen_tokenizer, ToolFormat.HERMES)
    said = [
        {"role": "tool", "name": "calculator", "content": "5"},
        {"role": "tool", "name": "calculator", "content": "6"},
    ]
    ids = r.result_ids(said)
    assert qwen_tokenizer.tok.decode(ids) == (
        "\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = formats.Renderer(CharTokenizer(), ToolFormat.PLAIN)
    assert CharTokenizer().decode(plain.result_ids([{"role": "tool", "name": "code", "content": "Error: X!"}])) == (
        ">error: x?:"  # the character tokenizer's alphabet: lower case, the rest as '?'
    )


# -- tools --------------------------------------------------------------------------------------


def test_schemas_come_from_hints_and_docstrings():
    [tool] = tools_of([("train.agent.tools[0]", calculator)])
    assert tool.name == "calculator" and tool.parameters == ["expression"]
    assert tool.schema["function"]["description"] == "Evaluate an arithmetic expression."

    def undocumented(x):
        return x

    with pytest.raises(ConfigError, match=r"^train\.agent\.tools\[1\]: 'undocumented' cannot be described"):
        schema_of(undocumented, "train.agent.tools[1]")


def _tool(fn) -> Tool:
    return tools_of([("t", fn)])[0]


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


def broken(n: int) -> int:
    """Fail.

    Args:
        n: Anything.
    """
    raise RuntimeError(f"broken on {n}")


def test_a_tool_that_raises_hangs_or_is_called_wrongly_is_the_models_to_read():
    t0 = time.perf_counter()
    out = run_calls(
        [
            (_tool(broken), "broken", {"n": 3}, None),
            (_tool(slow), "slow", {"seconds": 600}, None),  # hangs: abandoned after the limit
            (_tool(calculator), "calculator", {"expr": "1"}, None),
            (None, "missing", {}, None),
            (_tool(calculator), "calculator", None, "the call is not JSON"),
            (_tool(calculator), "calculator", {"expression": "6*7"}, None),
        ],
        timeout_s=0.5,
        most=100,
    )
    assert time.perf_counter() - t0 < 60  # the hung call did not hold the episode for its 600 s
    assert [(r.content, r.error) for r in out] == [
        ("error: RuntimeError: broken on 3", True),
        ("error: slow did not return within 0.5 s", True),
        ("error: TypeError: calculator() takes no argument 'expr'; it takes expression", True),
        ("error: unknown tool 'missing'", True),
        ("error: the call is not JSON", True),
        ("42", False),
    ]
    assert calculator("(48 + 24) / 2") == "36" and calculator("1/3") == "0.333333"
    with pytest.raises(ValueError, match="not arithmetic"):
        calculator("__import__('os')")


def test_load_toolbox_names_what_is_wrong(tmp_path):
    f = tmp_path / "t.py"
    f.write_text(
        "def lookup(key: str) -> str:\n    '''Look up.\n\n    Args:\n        key: A key.\n    '''\n    return key\n"
        "class NoReset:\n    pass\n"
    )
    box = load_toolbox(AgentConfig(tools=(f"{f}:lookup", "calculator"), environment="codebook"))
    assert box.names == ["lookup", "calculator", "code"] and box.env_class is Codebook
    with pytest.raises(ConfigError, match=r"^train\.agent\.tools\[0\]: tool file .*nope\.py"):
        load_toolbox(AgentConfig(tools=(f"{tmp_path}/nope.py:x",)))
    with pytest.raises(ConfigError, match=r"^train\.agent\.tools\[0\] 'wiki' is not a built-in tool"):
        load_toolbox(AgentConfig(tools=("wiki",)))
    with pytest.raises(ConfigError, match=r"NoReset has no reset method"):
        load_toolbox(AgentConfig(environment=f"{f}:NoReset"))


# -- episodes -----------------------------------------------------------------------------------


class Scripted:
    """A rollout engine that plays fixed turns: turn t of row i is script[i][t] (text; `<eos>` ends it)."""

    def __init__(self, tok: CharTokenizer, script: list[list[str]], n: int):
        self.tok, self.script, self.n, self.calls = tok, script, n, []

    def generate(self, prompt_tokens, prompt_valid, key, num_samples) -> Completions:
        turn = sum(1 for _ in self.calls)
        self.calls.append([np.asarray(t)[np.asarray(v)].tolist() for t, v in zip(prompt_tokens, prompt_valid)])
        rows = [s[turn] if turn < len(s) else "" for s in self.script]
        b = len(rows)
        tokens = np.zeros((b, self.n), np.int32)
        lengths = np.zeros(b, np.int32)
        for i, text in enumerate(rows):
            ids = [0 if piece == "<eos>" else self.tok.stoi[piece] for piece in _pieces(text)][: self.n]
            tokens[i, : len(ids)], lengths[i] = ids, len(ids)
        logprobs = np.where(np.arange(self.n)[None] < lengths[:, None], -0.5, 0.0).astype(np.float32)
        return Completions(tokens, logprobs, lengths, lengths == 0)


def _pieces(text: str) -> list[str]:
    out, rest = [], text
    while rest:
        if rest.startswith("<eos>"):
            out.append("<eos>")
            rest = rest[5:]
        else:
            out.append(rest[0])
            rest = rest[1:]
    return out


def _turns(tok, toolbox, **agent) -> episodes.Turns:
    cfg = AgentConfig(**{"max_turns": 3, "max_tokens": 16, **agent, "environment": "codebook"})
    return episodes.Turns.of(cfg, tok, toolbox, [0], 0, (4, 8, 16, 32), 4)


def _rows(*prompts, codes=("417", "903")):
    tok = CharTokenizer()
    rows = [{"prompt": p, "answer": c} for p, c in zip(prompts, codes)]
    return rows, [tok.encode(p) for p in prompts]


def test_an_episode_alternates_turns_and_results_and_trains_only_its_own_tokens():
    tok = CharTokenizer()
    box = load_toolbox(AgentConfig(environment="codebook"))
    rows, ids = _rows("abc?", "dea?")
    engine = Scripted(tok, [["#", "417<eos>"], ["12<eos>"]], n=4)
    from grpo_core.generate.sampler import pad_prompts

    ptok, pval = pad_prompts(ids, (4, 8), 0)
    eps, _, _ = episodes.run(engine.generate, _turns(tok, box), rows, ptok, pval, jax.random.key(0), 1)
    c = eps.completions
    # row 0: "#" (the call ends the turn), the result ">417:", then the answer; row 1 answers at once
    assert tok.decode(c.tokens[0, : c.lengths[0]]) == "#>417:417"
    assert c.trained[0, : c.lengths[0]].tolist() == [True] + [False] * 5 + [True] * 4
    assert c.trained[1, : c.lengths[1]].tolist() == [True] * 3 and c.lengths[1] == 3
    assert float(c.logprobs[0, 1:6].sum()) == 0.0 and c.logprobs[0, 0] == -0.5  # the sampler's, where it sampled
    assert eps.finals == ["417", "12"] and eps.turns.tolist() == [2, 1] and not c.truncated.any()
    assert eps.messages[0] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "code", "arguments": {}}}],
        },
        {"role": "tool", "name": "code", "content": "417"},
        {"role": "assistant", "content": "417"},
    ]
    # the second turn re-read the whole conversation: the prompt, the call and the result
    assert tok.decode(engine.calls[1][0]) == "abc?#>417:"
    assert eps.metrics(["code"])["tool_calls_per_episode"] == 0.5
    assert episodes.reward_columns(eps)["tool_calls"][0][0] == {
        "name": "code",
        "arguments": {},
        "result": "417",
        "error": False,
    }
    eps.close()


def test_episodes_are_cut_at_their_budget_and_their_turns():
    tok = CharTokenizer()
    box = load_toolbox(AgentConfig(environment="codebook"))
    rows, ids = _rows("abc?", "dea?", codes=("417", "903"))
    from grpo_core.generate.sampler import pad_prompts

    ptok, pval = pad_prompts(ids, (4, 8), 0)
    # row 0: a turn without its end (cut at max_new_tokens); row 1: calls on every turn, past max_turns
    engine = Scripted(tok, [["1234"], ["#", "#", "#"]], n=4)
    eps, _, _ = episodes.run(engine.generate, _turns(tok, box, max_turns=2), rows, ptok, pval, jax.random.key(0), 1)
    assert eps.completions.truncated.tolist() == [True, True]
    assert eps.turns.tolist() == [1, 2] and len(eps.calls[1]) == 1  # the last turn's call is never run
    # a result that does not fit the episode's tokens is left out, and the episode ends there
    engine = Scripted(tok, [["#", "9<eos>"], ["1<eos>"]], n=4)
    eps, _, _ = episodes.run(engine.generate, _turns(tok, box, max_tokens=5), rows, ptok, pval, jax.random.key(0), 1)
    assert eps.completions.truncated.tolist() == [True, False] and eps.completions.lengths[0] == 1
    assert [m["role"] for m in eps.messages[0]] == ["assistant"]


class Counter:
    """An environment with state, written as TRL's environment_factory classes are: reset(**row)
    returns the first observation, its public methods are the tools, get_reward scores the episode."""

    def __init__(self, start: int = 0):
        self.start, self.total, self.closed = start, start, False

    def reset(self, target: str = "", **row) -> str:
        self.total, self.target = self.start, int(target)
        return f" to {self.target}"

    def add(self, n: int) -> int:
        """Add to the running total.

        Args:
            n: How much.
        """
        self.total += int(n)
        return self.total

    def get_reward(self) -> float:
        return float(self.total == self.target)

    def close(self) -> None:
        self.closed = True


def test_an_environment_keeps_state_across_turns_and_owns_its_reward(tmp_path):
    tok = CharTokenizer()
    box = Toolbox([], Counter, {"start": 1}, tools_of([("train.agent.environment", Counter().add)]))
    turns = episodes.Turns.of(
        AgentConfig(environment="x:Counter", max_turns=4, max_tokens=32), tok, box, [0], 0, (8, 16, 32, 64), 4
    )
    rows = [{"prompt": "go", "target": "6"}]
    from grpo_core.generate.sampler import pad_prompts

    ptok, pval = pad_prompts([tok.encode("go")], (8,), 0)
    engine = Scripted(tok, [["2#", "3#", "6<eos>"], ["2#", "9#", "x<eos>"]], n=4)
    with_obs = lambda row, obs: tok.encode(row["prompt"] + obs)  # noqa: E731
    eps, ptok2, pval2 = episodes.run(engine.generate, turns, rows, ptok, pval, jax.random.key(0), 2, with_obs)
    # reset's observation joined the prompt the episodes saw (the same for both episodes of the row)
    assert tok.decode(np.asarray(ptok2[0])[np.asarray(pval2[0])]) == "go to 6"
    assert [[c.content for c in calls] for calls in eps.calls] == [["3", "6"], ["3", "12"]]  # each its own total
    envs = list(eps.envs)
    assert [e.get_reward() for e in envs] == [1.0, 0.0]
    eps.close()
    assert all(e.closed for e in envs)
    # an observation that differs between the episodes of one prompt cannot be a GRPO group
    import itertools

    seq = itertools.count()

    class Drifting(Counter):
        def reset(self, **row) -> str:
            return f" {next(seq)}"

    drifting = Toolbox([], Drifting, {}, box.env_tools)
    with pytest.raises(ConfigError, match=r"reset returned different observations for the 2 episodes"):
        episodes.run(
            engine.generate,
            turns.__class__(**{**turns.__dict__, "toolbox": drifting}),
            rows,
            ptok,
            pval,
            jax.random.key(0),
            2,
            with_obs,
        )


# -- the loss ------------------------------------------------------------------------------------


def test_the_tokens_an_episode_did_not_generate_get_no_gradient():
    """What lies at a tool result's positions (its log-probs under the sampler, the reference) is
    never read: the loss and every gradient are the same whatever is there, under the KL term,
    the entropy bonus and each aggregation; unmasked, the same positions would change them."""
    from flax import nnx

    from grpo_core.config.presets import get_preset
    from grpo_core.config.train import GRPOConfig, LossAggregation
    from grpo_core.nn.model import create_model
    from grpo_core.rl import algo
    from grpo_core.rl.learner import LossParams, _loss
    from grpo_core.rl.types import Batch

    tok = CharTokenizer()
    model = create_model(get_preset("tiny", vocab_size=tok.vocab_size), 0)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    p, g, n = 2, 2, 10
    trained = np.ones((p * g, n), bool)
    trained[:, 2:6] = False  # a call's result and the template's glue
    batch = Batch(
        prompt_tokens=jnp.asarray(rng.integers(1, tok.vocab_size, (p, 4)), jnp.int32),
        prompt_valid=jnp.ones((p, 4), bool),
        targets=jnp.asarray(rng.integers(1, tok.vocab_size, (p * g, n)), jnp.int32),
        mask=jnp.asarray(trained, jnp.float32),
        advantages=jnp.asarray([1.0, -1.0, 0.5, -0.5]),
        old_logp=jnp.asarray(rng.normal(-2, 0.3, (p * g, n)), jnp.float32),
        ref_logp=jnp.asarray(rng.normal(-2, 0.3, (p * g, n)), jnp.float32),
    )
    garbage = np.asarray(rng.normal(5, 9, (p * g, n)), np.float32)
    junk = batch._replace(
        old_logp=jnp.where(trained, batch.old_logp, garbage), ref_logp=jnp.where(trained, batch.ref_logp, -garbage)
    )
    for aggregation in LossAggregation:
        grpo = GRPOConfig(
            num_generations=g,
            prompts_per_step=p,
            beta=0.1,
            entropy_coef=0.05,
            loss_aggregation=aggregation,
            grad_accum_steps=1,
        )
        hp = LossParams.from_config(grpo, n, 1.0)
        weights = algo.token_weights(batch.mask, hp.aggregation, 1, n)
        assert float(jnp.abs(weights * (1 - batch.mask)).sum()) == 0.0
        # jitted (graphdef and hp static): op by op, the 12 calls cost ~17 CPU-s, each op compiled alone
        grad = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=(1, 4))
        (l1, _), g1 = grad(params, graphdef, batch, weights, hp, None)
        (l2, _), g2 = grad(params, graphdef, junk, weights, hp, None)
        assert float(l1) == float(l2), aggregation
        assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), g1, g2))), aggregation
        unmasked = jnp.ones_like(batch.mask)
        w_all = algo.token_weights(unmasked, hp.aggregation, 1, n)
        (l3, _), _ = grad(params, graphdef, junk._replace(mask=unmasked), w_all, hp, None)
        assert float(l3) != float(l1)  # the same positions, trained, would count
