"""The one table from failure to exit code: what the worker returns and what the task retries."""

import json
import subprocess
import sys

import pytest

from grpo_core import errors
from grpo_core.errors import ExitCode, classify, is_retryable


def test_errors_module_starts_no_jax_and_imports_no_grpo_core_module():
    code = (
        "import sys, grpo_core.errors\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m == 'jax' or (m.startswith('grpo_core.') and m != 'grpo_core.errors')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_table_covers_every_failure_code():
    assert {f.code for f in errors.FAILURES.values()} == set(ExitCode) - {ExitCode.OK, ExitCode.NOT_READY}
    for code in ExitCode:  # one answer per code, whichever exception produced it
        assert {f.retryable for f in errors.FAILURES.values() if f.code == code} <= {is_retryable(code)}
        assert code.kind


@pytest.mark.parametrize(
    "exc, code, event",
    [
        (errors.ConfigError("x"), 2, "config"),
        (FileNotFoundError("config.json"), 2, "config"),
        (json.JSONDecodeError("x", "{", 0), 2, "config"),
        (errors.DataError("x"), 2, "data"),
        (errors.RewardFunctionError("x"), 3, "reward"),
        (errors.StorageError("x"), 5, "storage"),
        (errors.NonFiniteError("x"), 6, "diverged"),
        (errors.RolloutError("x"), 7, "rollout"),
        (errors.RolloutTimeout("x"), 7, "rollout"),
        (errors.DistributedError("x"), 8, "distributed"),
        (MemoryError(), 9, "memory"),
    ],
)
def test_classify_gives_each_failure_its_code_and_event(exc, code, event):
    failure = classify(exc)
    assert (failure.code, failure.event) == (code, event)
    assert failure.retryable == is_retryable(code)


def test_classify_leaves_unknown_exceptions_to_the_caller():
    assert classify(ValueError("x")) is None and classify(RuntimeError("RESOURCE_EXHAUSTED")) is None
    assert classify(OSError("x")) is None  # only a missing file is the user's to fix


def test_what_is_retried():
    assert errors.NOT_RETRYABLE == {2, 3, 6, 9, 11}  # 11: storage that stays broken (issue 30)
    assert not any(is_retryable(c) for c in (2, 3, 6, 9, 11))
    assert all(is_retryable(c) for c in (1, 4, 5, 7, 8, -9, -15))  # crashes, kills and the retryable codes
    assert [ExitCode(c).kind for c in (2, 3, 6, 9)] == [
        "config or data error",
        "reward function error",
        "training diverged",
        "out of memory",
    ]


def test_the_old_homes_of_the_exceptions_still_export_them():
    from grpo_core.data.prepare import DataError
    from grpo_core.engines import RolloutError, RolloutTimeout
    from grpo_core.errors import ConfigError
    from grpo_core.launch.cluster import DistributedError
    from grpo_core.rewards.functions import RewardFunctionError
    from grpo_core.rl.trainer import NonFiniteError
    from grpo_core.store.root import StorageError

    assert (
        ConfigError,
        DataError,
        RolloutError,
        RolloutTimeout,
        DistributedError,
        RewardFunctionError,
        NonFiniteError,
        StorageError,
    ) == (
        errors.ConfigError,
        errors.DataError,
        errors.RolloutError,
        errors.RolloutTimeout,
        errors.DistributedError,
        errors.RewardFunctionError,
        errors.NonFiniteError,
        errors.StorageError,
    )
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(NonFiniteError, FloatingPointError) and issubclass(RolloutTimeout, RolloutError)


def test_the_worker_runs_no_hook_unless_one_is_named(tmp_path, monkeypatch):
    from grpo_core.stages import worker

    hook = tmp_path / "hook.py"
    hook.write_text(
        f"def seen(point, **info):\n    open({str(tmp_path / 'log')!r}, 'a').write(f'{{point}} {{info}}\\n')\n"
    )
    monkeypatch.delenv("GRPO_TEST_HOOK", raising=False)
    worker._test_hook("step", step=1)
    monkeypatch.setenv("GRPO_TEST_HOOK", f"{hook}:seen")
    worker._test_hook("step", step=2, root_url="r")
    worker._test_hook("checkpoint", step=2, root_url="r")
    assert (
        tmp_path / "log"
    ).read_text() == "step {'step': 2, 'root_url': 'r'}\ncheckpoint {'step': 2, 'root_url': 'r'}\n"
