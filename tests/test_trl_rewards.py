"""Reward functions written for TRL run here unchanged: they receive completion_ids and
trainer_state, and for chat data prompts and completions as message lists (TRL's
conversational format, `completion[0]["content"]`). Functions that take neither keep working."""

import copy

import pytest
from flax import nnx

from grpo_core.config.run import RunConfig
from grpo_core.data.synthetic import exact_match
from grpo_core.errors import ConfigError
from grpo_core.rewards.functions import Reward, TrainerState, reward_inputs, score, soft_overlong
from grpo_core.rewards.probe import probe
from grpo_core.rewards.registry import config_rewards
from grpo_core.rl.evaluation import evaluate
from grpo_core.rl.trainer import GRPOTrainer
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic

SEEN: list[dict] = []


def exact_reversal(prompts, completions, completion_ids, trainer_state, **kwargs):
    """Written as TRL documents conversational rewards: message lists in, one float per completion."""
    SEEN.append(
        {"prompts": prompts, "completions": completions, "ids": completion_ids, "step": trainer_state.global_step}
    )
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, kwargs["answer"])]


def older_style(prompts, completions, answer):
    """A function that names its column and takes no **kwargs: it gets no extra keywords."""
    return [float(completion.strip() == a) for completion, a in zip(completions, answer)]


class ChatTask:
    """The synthetic task with its prompts as chat messages, as data preparation keeps them."""

    def __init__(self, task):
        self.task = task

    def sample(self, step, round_, n):
        return [
            dict(r, prompt_messages=[{"role": "user", "content": r["prompt"]}])
            for r in self.task.sample(step, round_, n)
        ]


def _run(steps=2):
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    cfg["train"]["num_steps"] = steps
    return build_synthetic(cfg)


def test_a_trl_reward_gets_messages_ids_and_the_step_in_training():
    run = _run()
    SEEN.clear()
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, [Reward(exact_reversal)], ChatTask(run.task))
    for _ in range(2):
        tr.train_step()
    steps = [s["step"] for s in SEEN]  # trainer_state.global_step: the step being scored
    assert sorted(set(steps)) == [0, 1] and steps == sorted(steps)  # (dynamic sampling: rounds per step)
    first = SEEN[0]
    g = run.train.grpo.num_generations
    assert len(first["completions"]) == len(first["ids"]) == len(first["prompts"]) == run.train.grpo.batch_size
    assert first["prompts"][0] == [{"role": "user", "content": first["prompts"][0][0]["content"]}]
    assert first["prompts"][0] is first["prompts"][g - 1] or first["prompts"][0] == first["prompts"][g - 1]
    eos = set(run.tokenizer.eos_ids) if hasattr(run.tokenizer, "eos_ids") else {run.tokenizer.eos_token_id}
    for msg, ids in zip(first["completions"], first["ids"]):
        assert msg[0]["role"] == "assistant" and isinstance(ids, list)
        body = ids[:-1] if ids and ids[-1] in eos else ids  # the EOS that closed it is in the ids
        assert run.tokenizer.decode(body) == msg[0]["content"]


def test_a_trl_reward_in_evaluation_sees_the_evaluated_step():
    run = _run()
    SEEN.clear()
    rows = [dict(r, prompt_messages=[{"role": "user", "content": r["prompt"]}]) for r in run.eval_rows[:4]]
    graphdef, params = nnx.split(run.model)
    out = evaluate(
        graphdef,
        params,
        run.tokenizer,
        rows,
        [Reward(exact_reversal), Reward(exact_match)],
        run.train.sampling,
        batch_size=4,
        state=TrainerState(global_step=30, max_steps=60),
    )
    assert [s["step"] for s in SEEN] == [30]
    assert out["exact_reversal"] == out["exact_match"]  # a built-in reads message lists too


def test_functions_without_the_new_keywords_get_only_the_columns():
    rows = [{"prompt": "ab=", "answer": "ba"}, {"prompt": "cd=", "answer": "dc"}]
    prompts, completions, columns = reward_inputs(
        rows, ["ba", "xx"], completion_ids=[[1, 2], [3]], state=TrainerState(5, 10)
    )
    out = score([Reward(older_style)], prompts, completions, columns)
    assert list(out.total) == [1.0, 0.0]
    assert prompts == ["ab=", "cd="] and completions == ["ba", "xx"]  # text data: text, as before


def test_the_data_stage_probe_calls_a_trl_reward_with_messages():
    SEEN.clear()
    rows = [{"prompt": "ab=", "prompt_messages": [{"role": "user", "content": "ab="}], "answer": "ba"}]

    def conversational(prompts, completions, **kwargs):
        SEEN.append({"prompts": prompts, "completions": completions})
        return [float(c[0]["content"] == a) for c, a in zip(completions, kwargs["answer"])]

    cov = probe(Reward(conversational), rows, "train")
    assert cov.scored == 1 and SEEN[0]["prompts"] == [[{"role": "user", "content": "ab="}]]
    assert SEEN[0]["completions"][0][0]["role"] == "assistant"


def test_soft_overlong_punishment_pinned():
    """DAPO's: L_max 10, L_cache 4: 0 up to 6 tokens, then (6 - L) / 4 down to -1 at 10, -1 past it."""
    ids = [[0] * n for n in (3, 6, 7, 8, 10, 11)]
    got = soft_overlong(None, [""] * 6, ids, max_completion_len=10, soft_punish_cache=4)
    assert got == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]


def test_soft_overlong_from_a_config_with_its_params():
    cfg = RunConfig.from_dict(
        {
            "rewards": [
                {"function": "char_match"},
                {"function": "soft_overlong", "params": {"max_completion_len": 6, "soft_punish_cache": 2}},
            ]
        }
    )
    rewards, _ = config_rewards(cfg)
    over = rewards[1]
    assert over.name == "soft_overlong" and over.takes("completion_ids")
    rows = [{"prompt": "ab=", "answer": "ba"}] * 3
    prompts, completions, columns = reward_inputs(
        rows, ["ba", "baaaa", "baaaaaa"], completion_ids=[[1] * 3, [1] * 5, [1] * 7]
    )
    out = score([over], prompts, completions, columns)
    assert list(out.per_function["soft_overlong"]) == [0.0, -0.5, -1.0]
    assert RunConfig.from_dict({}).train_hash == "ecc6c5c954ea"  # rewards without params: the pinned default hash
    with pytest.raises(ConfigError, match=r"rewards\[0\].params: 'soft_overlong' needs 'soft_punish_cache'"):
        config_rewards(
            RunConfig.from_dict({"rewards": [{"function": "soft_overlong", "params": {"max_completion_len": 6}}]})
        )
