import atexit
import collections
import gc
import os
import shutil
import tempfile

import pytest

from tests.cpu_devices import FAST_COMPILE

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The project's caches live in one folder of the session's, never in the host's ~/.cache: worker
# processes share JAX's persistent compilation cache (the tests keep theirs to themselves), and
# `grpo check`'s XLA figures (grpo_core.stages.aot) and the models copied from URLs
# (grpo_core.store.sources) start empty, so that no result depends on what an earlier run left.
# Under pytest-xdist the controller imports this first and its test processes inherit the folders.
_CACHES = {"JAX_COMPILATION_CACHE_DIR": "jax", "GRPO_AOT_CACHE_DIR": "aot", "GRPO_MODEL_CACHE": "models"}
if not all(os.environ.get(var) for var in _CACHES):
    _cache = tempfile.mkdtemp(prefix="grpo-test-cache-")
    atexit.register(shutil.rmtree, _cache, True)
    for var, name in _CACHES.items():
        if not os.environ.get(var):
            os.environ[var] = os.path.join(_cache, name)
            os.makedirs(os.environ[var])

# XLA:CPU compiles the tests' programs without LLVM's optimisation passes (XLA's own HLO passes
# still run): nearly every test compiles more than it computes, and LLVM's passes are most of a
# compilation (tests/test_logprobs.py: 155 -> 59 CPU-s). Worker processes inherit it; the one test
# that computes for long (tests/test_trainer.py's learning run) drops it in a child process of its
# own (tests/cpu_devices.py). GRPO_TEST_XLA_OPT=1, or an optimisation level in XLA_FLAGS, keeps XLA's.
if os.environ.get("GRPO_TEST_XLA_OPT") != "1" and "xla_backend_optimization_level" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}".strip()

pytest_plugins = ["tests.prefect_server", "tests.gcs"]


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (`make test`: `-n 3 --dist loadfile --no-loadscope-reorder`), each module
    goes whole to one test process, in collection order: the modules with slow tests come first,
    most slow tests first, so that the many short modules fill the end and no process is left
    running one long module alone. Every process computes the same order (xdist checks it)."""
    if not hasattr(config, "workerinput"):  # a plain run keeps the files' order
        return
    slow = collections.Counter(_module(item) for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[_module(item)])  # a stable sort: otherwise the files' order


def pytest_collection_finish(session):
    """The test process's imports and collected tests live until it ends: frozen out of the cyclic
    collector, which would walk them at every full pass, and that collector runs less often
    (every 10000 allocations, not 700): JAX's tracing allocates fast. Measured on
    tests/test_logprobs.py and tests/test_loss_variants.py: 3.9 -> 1.1 CPU-s of collections."""
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.fixture
def hub_offline(monkeypatch, tmp_path):
    """No Hub, as a process started with HF_HUB_OFFLINE=1 sees it. huggingface_hub and datasets read
    the variable once, when first imported: where a test before this one in the same test process
    imported them, setting it alone left them online, and a Hub id's data retried the network for
    ~46 s before it failed."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for module in (huggingface_hub.constants, datasets.config):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


# GRPO_TEST_CPU=FILE: each test's CPU seconds (its process's and those of the processes it started and
# waited for, by setup, call and teardown) appended to FILE as tab-separated lines, for keeping the
# suite in budget on a 2-core machine, where the suite's wall time is its CPU time over the cores.
# `python -m bench.suite_cpu FILE` sums them by module.
_CPU_FILE = os.environ.get("GRPO_TEST_CPU")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_FILE:
        yield
        return
    import resource
    import time

    def now():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime, time.monotonic()

    before = now()
    yield
    after = now()
    figures = [f"{b - a:.2f}" for a, b in zip(before, after)]
    with open(_CPU_FILE, "a") as out:
        out.write("\t".join([item.nodeid, *figures, os.environ.get("PYTEST_XDIST_WORKER", "-"), _running()]) + "\n")


def _running() -> str:
    """The processes this test process started that still run (the session's Prefect server
    among them), as pid:name, from /proc: a test that leaves one running costs the tests after it."""
    parent: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
            if rest[0] != "Z":
                parent[int(entry)], names[int(entry)] = int(rest[1]), name
    mine, me = [], os.getpid()
    for pid in parent:
        p = parent[pid]
        while p > 1 and p != me:
            p = parent.get(p, 0)
        if p == me:
            mine.append(f"{pid}:{names[pid]}")
    return ",".join(sorted(mine))
