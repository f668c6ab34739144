"""GRPO from a notebook (flows.notebook): the example notebook executed headless in a Jupyter kernel
(its Dataset passed in memory, its reward defined in a cell and named by the metrics, the curve,
the export loaded with transformers), executed again in a new kernel (the same run folder,
nothing trained), and a reward's body edited (a new run); the digests that decide this, the rows
written once by content, and a kernel interrupt that stops the workers while the kernel lives on."""

import json
import linecache
import os
import pathlib
import shutil
import signal
import textwrap

import pytest

from grpo_core.data.in_memory import split_rows, write_rows
from grpo_core.errors import ConfigError, RunInterrupted
from grpo_core.rewards.by_value import digest, save_reward
from grpo_core.rewards.functions import load_reward

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "grpo_in_a_notebook.ipynb"
REWARD = """
def number_reward(prompts, completions, answer, **kwargs):
    return [float(str(a) in c) * SCALE for c, a in zip(completions, answer)]
"""


def _cell_function(source: str, cell: int, scale: float = 1.0, with_source: bool = True):
    """`number_reward` as a notebook's cell defines it: compiled from a file name of its own (IPython's
    `/tmp/ipykernel_*/N.py`), its text in linecache as IPython keeps it (or not: exec'd code)."""
    filename = f"/tmp/ipykernel_test/{cell}.py"
    if with_source:
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__", "SCALE": scale}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["number_reward"]


def test_a_reward_is_named_by_what_it_does_not_by_its_cell(tmp_path):
    same = [_cell_function(REWARD, cell) for cell in (1, 2)]
    assert digest(same[0]) == digest(same[1])  # the same text in another cell (a new kernel): the same run
    assert digest(_cell_function(REWARD.replace("float", "int"), 3)) != digest(same[0])  # its body edited
    assert digest(_cell_function(REWARD, 4, scale=0.5)) != digest(same[0])  # a global it reads, changed
    bare = [_cell_function(REWARD, cell, with_source=False) for cell in (5, 6)]  # no source kept: its code
    assert digest(bare[0]) == digest(bare[1]) != digest(same[0])
    spec = save_reward(same[0], str(tmp_path), "number_reward")
    assert spec == f"{tmp_path}/_inputs/rewards/{digest(same[0])}/number_reward.pkl:number_reward"
    folder = tmp_path / "_inputs" / "rewards" / digest(same[0])
    assert "return [float(str(a) in c) * SCALE" in (folder / "number_reward.py").read_text()  # its source beside it
    first = (folder / "number_reward.pkl").stat().st_mtime_ns
    assert save_reward(same[1], str(tmp_path), "number_reward") == spec  # written once
    assert (folder / "number_reward.pkl").stat().st_mtime_ns == first
    loaded = load_reward(spec)  # by value: no module of the test's is imported to load it
    assert loaded(["p"], ["it is 5", "no"], answer=[5, 5]) == [1.0, 0.0]


def test_rows_in_memory_are_written_once_by_their_content(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(6)]
    splits = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:2])}
    )
    train, held = split_rows(splits)
    assert train == rows and held == rows[:2]
    url = write_rows(train, str(tmp_path), "train")
    again = write_rows(datasets.Dataset.from_list(rows).to_list(), str(tmp_path), "train")
    assert url == again and url.startswith(f"{tmp_path}/_inputs/data/") and url.endswith("/train.jsonl")
    assert [json.loads(line) for line in pathlib.Path(url).read_text().splitlines()] == rows
    assert write_rows(rows[1:], str(tmp_path), "train") != url  # other rows: another file, a new run
    with pytest.raises(ConfigError, match=r"no split 'train' to train on; splits: \['a', 'b'\]"):
        split_rows({"a": rows, "b": rows})
    with pytest.raises(ConfigError, match="row 1 is a str, not a dict"):
        split_rows([rows[0], "text"])


def test_a_kernel_interrupt_stops_the_workers_and_the_kernel_lives_on(monkeypatch):
    """As Ctrl-C in the terminal (flows.cli): the first interrupt asks the running workers to stop at
    their step boundary (raising only once they did: the stage raises RunInterrupted), a second kills
    them; the kernel's own SIGINT handler is back afterwards, and the next run runs."""
    import tasks.process as process
    from flows.notebook import _interruptible

    stopped = []

    class Worker:  # a running worker set, as run_worker registers it
        procs = ()

        def stop(self, grace_s=None):
            stopped.append(grace_s)

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setitem(process._LIVE, 0, Worker())
    monkeypatch.setenv(process.STOP_REPORT_ENV, "600")
    monkeypatch.setattr(process, "_INTERRUPT", type(process._INTERRUPT)())  # this test's: the module's stays clear
    with pytest.raises(RunInterrupted, match="interrupted again: the workers were killed"):
        with _interruptible():
            os.kill(os.getpid(), signal.SIGINT)  # the first: the workers are asked to stop, nothing raised
            assert process._INTERRUPT.is_set() and not stopped
            os.kill(os.getpid(), signal.SIGINT)  # the second: killed now
    process._LIVE.clear()  # no worker running now
    assert stopped[0] == 0.5 and signal.getsignal(signal.SIGINT) is before
    with pytest.raises(RunInterrupted, match="^interrupted$"):  # no worker running: at once
        with _interruptible():
            os.kill(os.getpid(), signal.SIGINT)
    process.clear_interrupt()  # what train() does first: this kernel's next run runs
    assert not process._INTERRUPT.is_set()


def test_resolve_names_one_run_for_the_same_python_objects(tmp_path):
    """What train() runs, resolved without running it: dotted settings applied, a DatasetDict's test
    split evaluated on, callables (a weight, a lambda) pickled; the same objects again name the same
    run, a reward with another body another run."""
    datasets = pytest.importorskip("datasets")
    from flows.notebook import resolve

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1} #### {i + 1}"} for i in range(12)]
    data = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:3])}
    )
    reward = _cell_function(REWARD, 7)
    settings = {"storage.root": str(tmp_path), "train.num_steps": 3}

    def resolved(fn):
        return resolve(data=data, rewards=[(fn, 2.0), lambda prompts, completions, **kw: [0.0] * len(completions)],
                       overrides={"pipeline.epochs": 1}, **settings)  # fmt: skip

    cfg = resolved(reward)
    assert cfg.train.num_steps == 3 and cfg.pipeline.epochs == 1 and cfg.storage_url == str(tmp_path)
    assert [(r.function.rsplit(":", 1)[1], r.weight) for r in cfg.rewards] == [
        ("number_reward", 2.0),
        ("reward_1", 1.0),
    ]
    assert cfg.eval.accuracy_reward == "number_reward"
    assert cfg.data.source.endswith("/train.jsonl") and cfg.data.eval_source.endswith("/eval.jsonl")
    assert resolved(_cell_function(REWARD, 8)).run_url == cfg.run_url  # the cell run again
    assert resolved(_cell_function(REWARD.replace("* SCALE", "* SCALE * 2"), 9)).run_url != cfg.run_url
    with pytest.raises(ConfigError, match="unknown config section"):
        resolve(**{"num_steps": 3}, **settings)


def _outputs(nb, marker: str) -> str:
    """The text a notebook's cell (the first whose source holds `marker`) printed, shown or warned."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and marker in c.source)
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", "") if out.output_type == "stream" else json.dumps(out.get("data", {})))
    return "\n".join(parts)


def _printed(nb) -> str:
    """Everything the notebook's cells printed."""
    return "\n".join(out.get("text", "") for c in nb.cells for out in c.get("outputs", []))


def _execute(nb, cwd: pathlib.Path):
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    return nb


def _run_folders(runs: pathlib.Path) -> list[pathlib.Path]:
    """The run folders of the notebook's runs without tools (the agent's cell has one of its own)."""
    return [p for p in runs.iterdir() if p.is_dir() and not p.name.startswith("_") and not _agentic(p)]


def _agentic(run: pathlib.Path) -> bool:
    return bool(json.loads((run / "config.json").read_text())["train"].get("agent", {}).get("tools"))


def _trained(run: pathlib.Path) -> dict[str, int]:
    """The files training, evaluation and export wrote, with their modification times."""
    return {
        str(p.relative_to(run)): p.stat().st_mtime_ns
        for sub in ("checkpoints", "metrics", "eval", "export")
        for p in (run / sub).rglob("*")
        if p.is_file()
    }


@pytest.mark.slow
def test_the_example_notebook_trains_resumes_and_an_edited_reward_is_a_new_run(tmp_path, monkeypatch, request):
    """The example notebook headless, as Jupyter runs it, in a fresh folder: its Dataset in memory and
    its reward defined in a cell train a run whose metrics name that reward; the curve is shown; the
    export answers through transformers; the kernel's one Prefect server serves its second run, which
    finds the run done. Then the whole notebook again in a new kernel (against the session's
    server): the same folder, nothing trained; and the reward's body edited names a new run."""
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    for var in ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING"):  # the kernel starts its own server
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # offline, as the notebook says
    shutil.copy(NOTEBOOK, tmp_path / NOTEBOOK.name)

    nb = _execute(nbformat.read(tmp_path / NOTEBOOK.name, as_version=4), tmp_path)
    [run] = _run_folders(tmp_path / "runs")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 4, summary
    config = json.loads((run / "config.json").read_text())
    pickled = f"{tmp_path}/runs/_inputs/rewards/{_one(tmp_path, 'rewards')}/number_reward.pkl:number_reward"
    assert [r["function"] for r in config["rewards"]] == [pickled]
    assert config["data"]["source"] == f"{tmp_path}/runs/_inputs/data/{_one(tmp_path, 'data')}/train.jsonl"
    metrics = _outputs(nb, "run.metrics[")
    assert "rewards/number_reward/mean" in metrics  # the cell's reward, used in training and named
    assert "image/png" in _outputs(nb, "run.plot()")
    assert f"{run}/export/4" in _outputs(nb, "run.load_model()")
    assert _printed(nb).count("Prefect server for this kernel's runs") == 1  # started once, reused
    assert "same run: True | trained again: False" in _outputs(nb, "again = train(")
    # the agent's cell: a tool function from the cell, and episodes evaluated (their figures in the table)
    assert "tool_calls_per_episode" in _outputs(nb, "agent = train(")
    [agentic] = [p for p in (tmp_path / "runs").iterdir() if not p.name.startswith("_") and _agentic(p)]
    assert json.loads((agentic / "summary.json").read_text())["status"] == "completed"
    trained = _trained(run)

    edited = nbformat.read(tmp_path / NOTEBOOK.name, as_version=4)
    edited.cells.append(
        nbformat.v4.new_code_cell(
            textwrap.dedent(
                """
                from flows.notebook import resolve

                def number_reward(prompts, completions, answer, **kwargs):
                    return [0.5 for _ in completions]  # the body edited

                print("edited:", resolve(data=dataset, rewards=[number_reward], model="tiny-qwen", **settings).run_url)
                """
            )
        )
    )
    # The second kernel's runs go to the session's server (its own server is the first kernel's proof,
    # above): what it shows is the run folder, and a second server start costs ~10 CPU-s here.
    request.getfixturevalue("prefect_server")
    from tests.prefect_server import AUTH

    monkeypatch.setenv("PREFECT_API_URL", request.getfixturevalue("_session_server")[0])
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", AUTH)
    nb = _execute(edited, tmp_path)  # a new kernel: other cell file names, the same digests
    assert "Prefect server for this kernel's runs" not in _printed(nb)
    assert _run_folders(tmp_path / "runs") == [run] and _trained(run) == trained  # resumed: nothing trained
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["last_invocation"]["did_work"] is False, summary
    assert "same run: True | trained again: False" in _outputs(nb, "again = train(")
    # the agent's cell: a tool function from the cell, and episodes evaluated (their figures in the table)
    assert "tool_calls_per_episode" in _outputs(nb, "agent = train(")
    new_url = _outputs(nb, "the body edited").split("edited:", 1)[1].strip()
    assert new_url.startswith(f"{tmp_path}/runs/tiny-qwen-") and new_url != str(run)


def _one(tmp_path: pathlib.Path, kind: str) -> str:
    [folder] = (tmp_path / "runs" / "_inputs" / kind).iterdir()
    return folder.name
