"""Agentic GRPO through a chat template and the http rollout engine (issue 62, items 3 and 10): a
`grpo tiny-model` folder (Qwen3's template with tools), a file tool, and a scripted
OpenAI-compatible server on 127.0.0.1 playing the policy (tests/scripted_openai.py: it writes
Qwen's <tool_call> blocks, which a random tiny model never does). The episode over HttpEngine's
generate trains exactly the server's tokens; a whole run (`grpo run`: data, readiness, training
workers, evaluation) completes with two-turn episodes whose calls ran and whose results reached
the server as the template renders them."""

import json
import re

import jax
import numpy as np
import pytest

from grpo_core.agent import episodes
from grpo_core.agent.tools import load_toolbox
from grpo_core.config.agent import AgentConfig, ToolFormat
from grpo_core.config.train import PROMPT_BUCKETS
from grpo_core.generate.sampler import SamplerOptions, pad_prompts, stop_ids
from tests.scripted_openai import MODEL_ID, RELOAD_ROUTE, ScriptedServer, logprob_at

TOOL = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b
'''


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A `grpo tiny-model` folder: random Qwen3 weights, a byte-level BPE tokenizer, Qwen's template with tools."""
    from flows.cli import main

    folder = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    assert main(["tiny-model", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "tools.py"
    path.write_text(TOOL)
    return path


@pytest.fixture
def policy(tiny):
    server = ScriptedServer(str(tiny))
    yield server
    server.close()


def _call(a: int, b: int) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'


# what the template writes after the model's <|im_end|> for one result, through the next turn's header
GLUE = "\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_an_episode_over_the_http_engine_trains_exactly_the_servers_tokens(tiny, tool_file, policy):
    """episodes.run over HttpEngine.generate against the scripted server: a row that calls `add`
    gets the tool's result through the chat template and answers on its second turn, which re-reads
    the whole conversation (the prompt, the server's own call tokens, the template's glue); a row
    that answers at once ends after one turn. `trained` is 1 on the server's tokens, which are kept
    as it sent them with its log-probs, and 0 on the result and the template's glue (log-prob 0)."""
    from flax import nnx

    from grpo_core.config.train import RolloutConfig
    from grpo_core.data.tokenizer import WithTools
    from grpo_core.engines.http import HttpEngine
    from grpo_core.nn.hf import load_hf_model
    from grpo_core.store.sources import HFTokenizer

    box = load_toolbox(AgentConfig(tools=(f"{tool_file}:add",)))
    tok = WithTools(HFTokenizer(str(tiny)), box.schemas)
    agent = AgentConfig(tools=(f"{tool_file}:add",), max_turns=3, max_tokens=160)
    n_new = 72
    turns = episodes.Turns.of(agent, tok, box, stop_ids(tok), tok.pad_token_id, PROMPT_BUCKETS, n_new)
    assert turns.fmt is ToolFormat.HERMES and turns.budget == 160
    opts = SamplerOptions(n_new, 1.0, 0, 1.0, turns.eos_ids, tok.pad_token_id)
    model = load_hf_model(str(tiny))
    graphdef, params = nnx.split(model)
    rollout = RolloutConfig(engine="http", url=policy.url, reload_route=RELOAD_ROUTE)
    engine = HttpEngine(rollout, graphdef, model.config, opts, batch_size=4, tokenizer=tok)
    try:
        engine.sync(params, 0)  # exported, then the reload route: the server serves step 0
        [reload] = policy.reloads
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(reload["files"])

        questions = ["Tom has 2 apples and buys 3 more. How many apples?", "Say hello."]
        rows = [{"prompt_messages": [{"role": "user", "content": q}]} for q in questions]
        prompts = [
            tok.encode(tok.apply_chat_template(r["prompt_messages"], tokenize=False, add_generation_prompt=True))
            for r in rows
        ]
        assert "<tools>" in tok.tok.decode(prompts[0])  # the tool's schema in the system turn
        ptok, pval = pad_prompts(prompts, turns.buckets, turns.pad_id)
        eps, _, _ = episodes.run(engine.generate, turns, rows, ptok, pval, jax.random.key(0), 2)
    finally:
        engine.close()
    assert not policy.errors, policy.errors
    assert policy.models_asked == 1  # the served model's name, asked once
    first, second = policy.completions  # two turns: the second with every row, a stable shape
    assert first["body"]["model"] == MODEL_ID and first["body"]["max_tokens"] == n_new
    assert first["body"]["stop_token_ids"] == list(turns.eos_ids) and first["body"]["logprobs"] == 1
    assert first["body"]["prompt"] == [prompts[0], prompts[0], prompts[1], prompts[1]]  # G = 2 per prompt

    im_end = tok.tok.convert_tokens_to_ids("<|im_end|>")
    call = tok.tok.encode(_call(2, 3) + "<|im_end|>", add_special_tokens=False)
    glue = tok.tok.encode(GLUE.format(5), add_special_tokens=False)
    answer = tok.tok.encode("The answer is 5. #### 5<|im_end|>", add_special_tokens=False)
    hello = tok.tok.encode("Hello.<|im_end|>", add_special_tokens=False)
    assert call[-1] == im_end and len(call) <= n_new  # the server's call fits a turn, ending at the end of turn
    c = eps.completions
    for i in (0, 1):  # both episodes of the first prompt: call, result, answer
        assert c.tokens[i, : c.lengths[i]].tolist() == call + glue + answer
        mask = c.trained[i, : c.lengths[i]].tolist()
        assert mask == [True] * len(call) + [False] * len(glue) + [True] * len(answer)
        assert not c.trained[i, c.lengths[i] :].any()
        lp = c.logprobs[i, : c.lengths[i]]
        want = (
            [logprob_at(k) for k in range(len(call))] + [0.0] * len(glue) + [logprob_at(k) for k in range(len(answer))]
        )
        np.testing.assert_allclose(lp, want, rtol=1e-6)
        # the second turn re-read the prompt, the server's own call tokens and the template's glue, as they are
        assert second["body"]["prompt"][i] == prompts[0] + call + glue
        assert second["prompts"][i].endswith(_call(2, 3) + "<|im_end|>" + GLUE.format(5))
        assert eps.messages[i] == [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}],
            },
            {"role": "tool", "name": "add", "content": "5"},
            {"role": "assistant", "content": "The answer is 5. #### 5"},
        ]
    for i in (2, 3):  # the second prompt: answered at once, one turn, all of it trained
        assert c.tokens[i, : c.lengths[i]].tolist() == hello and c.trained[i, : c.lengths[i]].all()
        assert eps.messages[i] == [{"role": "assistant", "content": "Hello."}]
    assert eps.turns.tolist() == [2, 2, 1, 1] and not c.truncated.any()
    assert eps.finals == ["The answer is 5. #### 5"] * 2 + ["Hello."] * 2
    assert [[(x.name, x.arguments, x.content, x.error) for x in calls] for calls in eps.calls] == [
        [("add", {"a": 2, "b": 3}, "5", False)]
    ] * 2 + [[]] * 2
    m = eps.metrics(["add"])
    assert m["tool_calls_per_episode"] == 0.5 and m["turns_per_episode"] == 1.5 and m["tools/add/calls"] == 0.5
    eps.close()


# -- the whole pipeline ----------------------------------------------------------------------------

# A user's reward that reads the episodes' calls as TRL's reward functions do (`tool_calls`; text prompts
# rendered by data.chat stay text, so `completions` are the final answers), and keeps what it read
EPISODE_REWARD = """
import json

def one_call(prompts, completions, tool_calls, trainer_state, **_):
    step = [trainer_state.global_step, trainer_state.max_steps]
    with open({log!r}, "a") as f:
        for prompt, answer, calls in zip(prompts, completions, tool_calls):
            f.write(json.dumps({{"step": step, "prompt": prompt, "answer": answer, "tool_calls": calls}}) + "\\n")
    return [float(len(calls) == 1 and not calls[0]["error"]) for calls in tool_calls]
"""


def _gsm8k(path, pairs):
    """GSM8K-style rows: a question, an answer ending in '#### N'."""
    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            "answer": f"{a}+{b}.\n#### {a + b}",
        }
        for a, b in pairs
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_run_on_a_tiny_model_with_a_file_tool_over_the_http_engine(tmp_path, tiny, tool_file, policy):
    """`grpo run` on a `grpo tiny-model` folder, GSM8K-style chat data, a file tool, the http engine
    pointed at the scripted server: the run completes; every training episode called `add` on its
    question's numbers, read the result through the template and answered it (two turns, reward
    1); the server was sent each export and, on each second turn, the conversation with the
    template's <tool_response> and the next assistant header; the evaluation (the built-in sampler on
    the checkpoint, as for every engine) keeps its episodes' messages in eval/<step>.json."""
    from flows.cli import main
    from grpo_core.store.root import RunRoot

    train_pairs = [(2, 3), (11, 4), (7, 8), (20, 5), (6, 6), (13, 9), (31, 2), (4, 40)]
    train = _gsm8k(tmp_path / "train.jsonl", train_pairs)
    test = _gsm8k(tmp_path / "test.jsonl", [(3, 4), (10, 20)])
    log = tmp_path / "episodes.jsonl"
    (tmp_path / "episode_reward.py").write_text(EPISODE_REWARD.format(log=str(log)))
    sets = [
        f"storage.root={tmp_path}/runs",
        "run_name=agent-http",
        f"model.path={tiny}",
        f"data.source={train}",
        f"data.eval_source={test}",
        "data.eval_rows=all",
        "data.chat=true",
        "data.max_prompt_tokens=512",  # the tools' schemas in the system turn: ~420 tokens of this small BPE
        f"rewards=[{{function: math_answer}}, {{function: {tmp_path}/episode_reward.py:one_call}}]",
        "eval.rewards=[math_answer]",
        "eval.num_samples=1",
        "eval.batch_size=2",
        "train.num_steps=2",
        "train.grpo.prompts_per_step=2",
        "train.grpo.num_generations=2",
        "train.sampling.max_new_tokens=72",  # the server's call is 65 tokens of this BPE
        f"train.agent={{tools: [{tool_file}:add], max_turns: 2}}",
        f"train.rollout={{engine: http, url: {policy.url}, reload_route: {RELOAD_ROUTE}}}",
        "pipeline.epochs=1",
        "pipeline.checkpoint_every=2",
        "pipeline.retries=0",
        "pipeline.flow_retries=0",
    ]
    assert main(["run", *[a for s in sets for a in ("--set", s)]]) == 0
    assert not policy.errors, policy.errors
    run = RunRoot(str(tmp_path / "runs" / "agent-http"))
    assert run.read_json("summary.json")["status"] == "completed"

    # the metrics rows: every episode one call, no error, two turns; both rewards 1
    rows = run.read_metrics()
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert r["tool_calls_per_episode"] == 1.0 and r["turns_per_episode"] == 2.0, r
        assert r["tool_errors_per_episode"] == 0.0 and r["tools/add/calls"] == 1.0, r
        assert r["rewards/math_answer/mean"] == 1.0 and r["rewards/one_call/mean"] == 1.0, r

    # what the reward read: each episode's parsed call and the tool's result, its final answer
    # (the data check's probe calls it first, with the rows' reference answers and no calls: max_steps 0)
    read = [json.loads(line) for line in log.read_text().splitlines()]
    seen = [s for s in read if s["step"][1] == 2]
    assert [s["step"][0] for s in seen] == [0] * 4 + [1] * 4  # steps x prompts x generations
    assert all(s["step"] == [0, 0] and s["tool_calls"] == [] for s in read if s not in seen)
    for s in seen:
        a, b = map(int, re.findall(r"\d+", s["prompt"].rsplit("<|im_start|>user\n", 1)[1]))
        assert s["tool_calls"] == [{"name": "add", "arguments": {"a": a, "b": b}, "result": str(a + b), "error": False}]
        assert s["answer"] == f"The answer is {a + b}. #### {a + b}"

    # the server: each step's export reloaded before that step's two turns (a first turn, then every row's
    # conversation with its result), and the policy after the last update exported too
    assert policy.events == [
        ("reload", "step-0"),
        ("completions", 4),
        ("completions", 4),
        ("reload", "step-1"),
        ("completions", 4),
        ("completions", 4),
        ("reload", "step-2"),
    ]
    assert all({"config.json", "model.safetensors", "tokenizer.json"} <= set(r["files"]) for r in policy.reloads)
    for first, second in zip(policy.completions[::2], policy.completions[1::2]):
        for before, after in zip(first["prompts"], second["prompts"]):
            a, b = map(int, re.findall(r"\d+", before.rsplit("<|im_start|>user\n", 1)[1]))
            assert "<tools>" in before and before.endswith("<|im_start|>assistant\n")
            assert after == before + _call(a, b) + "<|im_end|>" + GLUE.format(a + b)

    # the evaluation: its episodes' messages next to the numbers. It runs the built-in sampler on the checkpoint
    # (grpo_core.rl.evaluation, whatever train.rollout.engine is), so these are the random model's turns
    final = run.read_json("eval/2.json")
    assert final["greedy"]["num_rows"] == 2.0 and "turns_per_episode" in final["greedy"]
    for example in final["examples"]:
        assert example["episode"] and example["episode"][0]["role"] == "assistant"
        assert example["completion"] == example["episode"][-1]["content"] or example["episode"][-1]["role"] == "tool"
