import pytest

from grpo_core.config.fields import apply_overrides
from grpo_core.config.train import (
    GRPOConfig,
    LossAggregation,
    OptimizerConfig,
    SamplingConfig,
    TrainConfig,
)
from grpo_core.errors import ConfigError


@pytest.mark.parametrize(
    "cls, kwargs, msg",
    [
        (GRPOConfig, {"num_generations": 1}, "grpo.num_generations must be >= 2, got 1"),
        (GRPOConfig, {"epsilon_low": 1.5}, r"grpo.epsilon_low must be in \[0, 1\), got 1.5"),
        (GRPOConfig, {"beta": -0.1}, "grpo.beta must be >= 0, got -0.1"),
        (GRPOConfig, {"dual_clip": 0.5}, "grpo.dual_clip must be > 1"),
        (
            GRPOConfig,
            {"loss_aggregation": "mean"},
            "train.grpo.loss_aggregation must be one of token_mean, .*; got 'mean'",
        ),
        (GRPOConfig, {"advantage": "dr_grpo"}, "dr_grpo does not divide by a std; set grpo.scale_rewards=none"),
        (GRPOConfig, {"prompts_per_step": 3, "grad_accum_steps": 2}, r"grpo.prompts_per_step \(3\) must divide evenly"),
        (SamplingConfig, {"top_p": 0.0}, r"sampling.top_p must be in \(0, 1\], got 0.0"),
        (SamplingConfig, {"prompt_buckets": (16, 8)}, "sampling.prompt_buckets must be increasing"),
        (SamplingConfig, {"max_new_tokens": 0}, "sampling.max_new_tokens must be >= 1, got 0"),
        (OptimizerConfig, {"learning_rate": 0}, "optimizer.learning_rate must be > 0, got 0"),
        (OptimizerConfig, {"max_grad_norm": -1.0}, "optimizer.max_grad_norm must be > 0 or null, got -1.0"),
    ],
)
def test_bad_values_name_the_field(cls, kwargs, msg):
    with pytest.raises(ConfigError, match=msg):
        cls(**kwargs)


def test_greedy_training_is_refused():
    with pytest.raises(ConfigError, match="sampling.temperature must be > 0 for training"):
        TrainConfig(sampling=SamplingConfig(temperature=0.0))


def test_round_trip_and_string_enums():
    cfg = TrainConfig.from_dict(
        {"grpo": {"loss_aggregation": "bnpo", "beta": 0.04}, "sampling": {"prompt_buckets": [8, 16]}}
    )
    assert cfg.grpo.loss_aggregation is LossAggregation.BNPO and cfg.sampling.prompt_buckets == (8, 16)
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_field_is_named():
    with pytest.raises(ConfigError, match=r"train.grpo: unknown field\(s\) \['num_gens'\]"):
        TrainConfig.from_dict({"grpo": {"num_gens": 4}})


def test_overrides():
    d = apply_overrides(
        {"train": {"grpo": {"beta": 0.0}}}, ["train.grpo.beta=0.04", "train.sampling.top_k=5", "x=[1, 2]"]
    )
    assert d == {"train": {"grpo": {"beta": 0.04}, "sampling": {"top_k": 5}}, "x": [1, 2]}
    with pytest.raises(ConfigError, match="must look like key.path=value"):
        apply_overrides({}, ["train.grpo.beta"])


def test_yaml_strings_are_coerced_or_named():
    cfg = TrainConfig.from_dict({"optimizer": {"learning_rate": "5e-4"}, "grpo": {"dynamic_sampling": "true"}})
    assert cfg.optimizer.learning_rate == 5e-4 and cfg.grpo.dynamic_sampling is True
    with pytest.raises(ConfigError, match="train.optimizer.learning_rate must be float, got 'fast'"):
        OptimizerConfig(learning_rate="fast")
    with pytest.raises(ConfigError, match="train.grpo.num_generations must be int, got 2.5"):
        GRPOConfig(num_generations=2.5)
