import copy

import pytest
from flax import nnx

from grpo_core.rewards.functions import Reward
from grpo_core.rl.evaluation import evaluate, pass_at_k
from grpo_core.testing import SYNTHETIC_DEFAULT, build_synthetic


@pytest.mark.parametrize(
    "n, c, k, want",
    [
        (4, 0, 1, 0.0),
        (4, 4, 2, 1.0),
        (4, 1, 1, 0.25),  # 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
    ],
)
def test_pass_at_k(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want)


def test_evaluate_greedy_and_sampled():
    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    run = build_synthetic(cfg)
    graphdef, params = nnx.split(run.model)

    def always_one(prompts, completions, **_):
        return [1.0] * len(completions)

    rows = run.eval_rows[:10]
    greedy = evaluate(graphdef, params, run.tokenizer, rows, [Reward(always_one)], run.train.sampling, batch_size=4)
    assert greedy["num_rows"] == 10 and greedy["always_one"] == 1.0 and "pass@1" not in greedy
    sampled = evaluate(
        graphdef,
        params,
        run.tokenizer,
        rows,
        run.eval_rewards + [Reward(always_one, 0.0)],
        run.train.sampling,
        batch_size=4,
        num_samples=4,
    )
    assert sampled["pass@1"] <= sampled["pass@4"] <= 1.0
    assert 0.0 <= sampled["exact_match"] <= 1.0
