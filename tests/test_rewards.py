import numpy as np
import pytest

from grpo_core.rewards.functions import Reward, RewardFunctionError, load_reward, score

PROMPTS = ["p0", "p1", "p2", "p3"]
COMPLETIONS = ["a", "bb", "ccc", "dddd"]


def length(prompts, completions, **_):
    return [float(len(c)) for c in completions]


def test_weighted_sum_and_per_function_values():
    def has_b(prompts, completions, **_):
        return [1.0 if "b" in c else 0.0 for c in completions]

    res = score([Reward(length, 0.5), Reward(has_b, 2.0)], PROMPTS, COMPLETIONS)
    np.testing.assert_allclose(res.total, [0.5, 3.0, 1.5, 2.0])
    np.testing.assert_allclose(res.per_function["has_b"], [0, 1, 0, 0])


def test_none_skips_a_function_and_a_row_nothing_applies_to():
    def only_even(prompts, completions, **_):
        return [1.0 if i % 2 == 0 else None for i in range(len(completions))]

    def only_first(prompts, completions, **_):
        return [5.0] + [None] * (len(completions) - 1)

    res = score([Reward(only_even), Reward(only_first)], PROMPTS, COMPLETIONS)
    assert res.total[0] == 6.0 and res.total[2] == 1.0
    assert np.isnan(res.total[1]) and np.isnan(res.total[3])  # excluded rows


def test_columns_are_passed_through():
    def match(prompts, completions, answer, **_):
        return [float(c == a) for c, a in zip(completions, answer)]

    res = score([Reward(match)], PROMPTS, COMPLETIONS, {"answer": ["a", "x", "ccc", "y"]})
    np.testing.assert_allclose(res.total, [1, 0, 1, 0])


def test_raising_function_names_itself_and_the_row():
    def picky(prompts, completions, **_):
        return [1.0 / (3 - len(c)) for c in completions]  # row 2 divides by zero

    with pytest.raises(
        RewardFunctionError, match=r"'picky' raised ZeroDivisionError: .* on row 2 \(prompt 'p2', completion 'ccc'\)"
    ):
        score([Reward(picky)], PROMPTS, COMPLETIONS)


@pytest.mark.parametrize(
    "out, msg",
    [
        ([1.0, 2.0], "'bad' returned 2 values for 4 completions"),
        ([1.0, "x", 0.0, 0.0], r"'bad' returned 'x' for row 1 \(completion 'bb'\)"),
        ([1.0, 0.0, float("nan"), 0.0], r"'bad' returned nan for row 2 .* use None to skip a row"),
        (3.0, "'bad' returned float, expected a list of 4 floats"),
    ],
)
def test_misbehaving_function_is_named(out, msg):
    def bad(prompts, completions, **_):
        return out

    with pytest.raises(RewardFunctionError, match=msg):
        score([Reward(bad)], PROMPTS, COMPLETIONS)


def test_load_reward_from_file_and_module(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def short(prompts, completions, **kw):\n    return [1.0 / len(c) for c in completions]\n"
        "def wrong(x):\n    return []\n"
    )
    fn = load_reward(f"{f}:short")
    assert fn(["p"], ["ab"]) == [0.5]
    assert load_reward("grpo_core.data.synthetic:exact_match")(["p"], ["ab"], answer=["ab"]) == [1.0]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward(f"{tmp_path}/nope.py:short")
    with pytest.raises(AttributeError, match="has no function 'missing'"):
        load_reward(f"{f}:missing")
    with pytest.raises(TypeError, match=r"must accept \(prompts, completions, \*\*columns\)"):
        load_reward(f"{f}:wrong")
    with pytest.raises(ValueError, match="must look like"):
        load_reward("no_colon")


REWARD_FILE = """import dataclasses

@dataclasses.dataclass
class Cfg:  # a dataclass needs its module registered while the file runs
    bonus: float = 1.0

def ok(prompts, completions, **columns):
    return [Cfg().bonus for _ in completions]

def one_arg(completions):
    return []

def positional_only(prompts, completions, answer, /, **kw):
    return []

NOT_A_FUNCTION = 3
"""


@pytest.mark.parametrize(
    "spec, message",
    [
        ("{p}/nope.py:ok", "rewards[0].function: reward file '{p}/nope.py' (from '{p}/nope.py:ok') does not exist"),
        (
            "{p}/r.py:missing",
            "rewards[0].function: reward '{p}/r.py:missing': {p}/r.py has no function 'missing'; "
            "it defines Cfg, ok, one_arg, positional_only",
        ),
        (
            "{p}/r.py:NOT_A_FUNCTION",
            "rewards[0].function: reward '{p}/r.py:NOT_A_FUNCTION': {p}/r.py.NOT_A_FUNCTION is a int, not a function",
        ),
        (
            "{p}/r.py:one_arg",
            "rewards[0].function: reward '{p}/r.py:one_arg' must accept (prompts, completions, "
            "**columns); its signature is one_arg(completions)",
        ),
        ("{p}/r.py:positional_only", "takes answer positionally only, but dataset columns arrive as keywords"),
        (
            "{p}/syntax.py:f",
            "rewards[0].function: reward file '{p}/syntax.py' (from '{p}/syntax.py:f') fails to import: SyntaxError: ",
        ),
        ("{p}/raises.py:f", "fails to import: NameError: name 'undefined_name' is not defined (line 2)"),
        ("{p}/imports.py:f", "fails to import: ModuleNotFoundError: No module named 'no_such_dependency_xyz' (line 1)"),
        (
            "no_such_module_xyz.rewards:f",
            "rewards[0].function: reward module 'no_such_module_xyz.rewards' (from "
            "'no_such_module_xyz.rewards:f') is not installed or not on sys.path",
        ),
        (
            "grpo_core.data.synthetic:nope",
            "reward 'grpo_core.data.synthetic:nope': grpo_core.data.synthetic has no function 'nope'",
        ),
        ("{p}/r.py:", "must look like 'path/to/file.py:function' or 'module:function'"),
        ("nothing_like_a_spec", "rewards[0].function 'nothing_like_a_spec' is not a built-in reward"),
    ],
)
def test_reward_loading_errors_name_the_field_and_the_problem(tmp_path, spec, message):
    from grpo_core.config.run import RewardSpec
    from grpo_core.errors import ConfigError
    from grpo_core.rewards.registry import make_rewards

    (tmp_path / "r.py").write_text(REWARD_FILE)
    (tmp_path / "syntax.py").write_text("def f(prompts, completions, **kw):\n    return [1.0 for c in completions\n")
    (tmp_path / "raises.py").write_text(
        "x = 1\ny = undefined_name\ndef f(prompts, completions, **kw):\n    return []\n"
    )
    (tmp_path / "imports.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError) as err:
        make_rewards((RewardSpec(function=spec.format(p=tmp_path)),))
    assert message.format(p=tmp_path) in str(err.value)


def test_a_reward_file_with_a_dataclass_loads_and_runs(tmp_path):
    (tmp_path / "r.py").write_text(REWARD_FILE)
    fn = load_reward(f"{tmp_path}/r.py:ok")
    assert score([Reward(fn)], ["p"], ["c"]).total.tolist() == [1.0]
