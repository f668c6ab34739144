"""The docs: the site builds with --strict (a broken link or anchor fails it), its config reference
holds every field the config declares (generated from the declarations, so it cannot drift), the
README stays a five-minute read whose links lead somewhere, the quickstart's command blocks run
as written, and `grpo tiny-model` writes a model that transformers and this project load alike."""

import dataclasses
import enum
import html
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import typing

import numpy as np
import pytest

from grpo_core.config.fields import Section
from grpo_core.config.model import ModelConfig
from grpo_core.config.run import RunConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
BIN = pathlib.Path(sys.executable).parent
# The marker of a command block the tests run (an HTML comment: the site and GitHub show nothing).
RUN_MARK = "<!-- test: run -->"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> pathlib.Path:
    """The site as `make docs` builds it (strict), into a folder of the test's."""
    out = tmp_path_factory.mktemp("site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    proc = subprocess.run(
        [str(BIN / "mkdocs"), "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    return out


# -- the config reference ------------------------------------------------------------------------


def _section_class(hint) -> type | None:
    """The Section a field's type hint holds (Optional[...] or tuple[X, ...] unwrapped), or None."""
    for arg in (hint, *typing.get_args(hint)):
        if isinstance(arg, type) and issubclass(arg, Section):
            return arg
    return None


def _declared(cls: type, path: str) -> list[tuple[str, typing.Any, dataclasses.Field]]:
    """Every field under the dataclass `cls` at `path`, read from the dataclasses themselves (not
    the generator's own walk): (path, type hint, field), sections included and descended into."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        name = {"storage_root": "storage.root"}.get(f.name, f.name) if cls is RunConfig else f.name
        if cls is RunConfig and name.split(".")[0] not in RunConfig.SECTIONS:
            continue  # derived or recorded by the run (versions, ...), never written by a user
        where = f"{path}.{name}".lstrip(".")
        sub = _section_class(hints[f.name])
        if cls is RunConfig and typing.get_origin(hints[f.name]) is tuple:
            out.append((where, hints[f.name], f))  # rewards: a list, each a rewards[] section
            out += _declared(sub, f"{where}[]")
            continue
        if sub is not None and cls is RunConfig:
            out += _declared(sub, where)  # model, data, train, eval, pipeline: the sections themselves
            continue
        if name == "overrides" and where == "model.overrides":  # the architecture's fields, by their own names
            out += _declared(ModelConfig, "model")
            continue
        out.append((where, hints[f.name], f))
        if sub is not None:
            out += _declared(sub, where)
    return out


def _rows(page: str) -> dict[str, str]:
    """The reference page's table rows (their HTML), by the field path each row's anchor names."""
    rows = {}
    for row in re.findall(r"<tr>(.*?)</tr>", page, re.S):
        m = re.search(r'<a id="([^"]+)"></a>', row)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} is on the page twice"
            rows[m.group(1)] = row
    return rows


def test_the_config_reference_holds_every_declared_field(site):
    """Built by the site's hook from the declarations: every field of every section (nested ones,
    the optional ones such as model.lora, the architecture's overrides, a reward's fields) has a
    row with its name, and its row shows its type, its default, each choice of an enum and each
    bound. The generated page is in the site, not written into docs/."""
    page = (site / "reference" / "config.html").read_text()
    rows = _rows(page)
    declared = _declared(RunConfig, "")
    assert len(declared) > 150, len(declared)  # the walk itself found the sections
    missing = [path for path, _, _ in declared if path not in rows or f"<code>{path}</code>" not in rows[path]]
    assert not missing, f"fields missing from the built config reference: {missing}"
    for path, hint, f in declared:
        cells = [
            html.unescape(re.sub(r"<[^>]+>", "", c)).strip() for c in re.findall(r"<td>(.*?)</td>", rows[path], re.S)
        ]
        name, kind, default, allowed, doc = cells
        assert kind and default, (path, cells)
        choices = next(
            (a for a in (hint, *typing.get_args(hint)) if isinstance(a, type) and issubclass(a, enum.Enum)), None
        )
        if choices is not None:
            assert all(m.value in allowed for m in choices), (path, allowed)
        for rule, bound in f.metadata.get("bounds", {}).items():
            assert str(bound) in allowed, (path, rule, bound, allowed)
        if f.metadata.get("doc"):
            assert doc.startswith(f.metadata["doc"].strip()[:30]), (path, doc)
    # a few rows as a user reads them
    cells = rows["train.grpo.num_generations"]
    assert "≥ 2" in cells and "<code>8</code>" in cells
    assert "<code>token_mean</code>" in rows["train.grpo.loss_aggregation"]
    assert "your data: <code>256</code>" in rows["train.sampling.max_new_tokens"]  # the 'hf' recipe's
    assert not (ROOT / "docs" / "reference" / "config.md").exists()
    # the trust policy's totals on work (grpo_core.config.work), each with its limit and formula
    from grpo_core.config.work import TOTALS

    for total in TOTALS:
        assert f"{total.api_max:,}" in rows[total.name] and "<code>data.max_prompt_tokens</code>" in rows[total.name]
    assert "address" in rows["pipeline.report_to"]  # a tracker that sends is an address (trust.md)


def test_the_generator_writes_the_same_page_alone(tmp_path):
    """`python docs/hooks/config_reference.py FILE`: the reference without building the site."""
    out = tmp_path / "config.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "hooks" / "config_reference.py"), str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Config reference") and "`train.grpo.beta`" in text and "`model.lora.rank`" in text


def test_the_site_has_every_page_and_the_architecture(site):
    """Every Markdown page of docs/ is built (DESIGN.md, the architecture, at its old path too)."""
    pages = sorted(p.relative_to(ROOT / "docs") for p in (ROOT / "docs").rglob("*.md"))
    assert pathlib.Path("DESIGN.md") in pages
    for page in pages:
        built = site / page.with_suffix(".html")
        assert built.exists(), f"{page} was not built"
    assert "The boundaries that matter" in (site / "DESIGN.html").read_text()


def test_the_built_site_browses_from_disk(site):
    """(issue 65 item 5) A link in the built site names the page's file, so a click opens the page
    from disk (file://), not a folder's listing."""
    import re as _re

    index = (site / "index.html").read_text()
    hrefs = [h for h in _re.findall(r'href="([^"#:]+)"', index) if not h.endswith((".css", ".js", ".png", ".svg"))]
    assert hrefs and not [h for h in hrefs if h.endswith("/")], hrefs  # no link to a folder
    assert "reference/config.html" in index and all((site / h).is_file() for h in hrefs if h.endswith(".html"))


# -- the README ----------------------------------------------------------------------------------


def test_the_readme_is_a_five_minute_read_whose_links_lead_somewhere():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    for needed in ("make demo", "make test", "grpo tiny-model", "grpo serve", RUN_MARK):
        assert needed in text, needed
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert local, "the README links to no page"
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing


# -- the quickstart runs as written --------------------------------------------------------------


def _marked_blocks(text: str) -> list[str]:
    return re.findall(re.escape(RUN_MARK) + r"\s*```bash\n(.*?)```", text, re.S)


def _run_block(block: str, cwd: pathlib.Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`block` in bash -e, in its own process group (killed whole if it outlives `timeout`)."""
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the block did not finish in {timeout} s:\n{out[-5000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_the_quickstart_blocks_are_marked_and_the_readme_shows_the_same():
    """The offline quickstart is marked to run, on the site and in the README, and both show the
    same block, so the one run below holds both."""
    page = _marked_blocks((ROOT / "docs" / "quickstart.md").read_text())
    readme = _marked_blocks((ROOT / "README.md").read_text())
    assert page and readme
    assert set(readme) <= set(page), "the README's quickstart block differs from docs/quickstart.md's"


@pytest.mark.usefixtures("prefect_server")  # ~35 s: not `slow` (over ~60 s)
def test_the_quickstart_runs_as_written(tmp_path):
    """Every marked block of the quickstart (and the README), exactly as written, in a fresh
    folder with the virtual environment's bin/ on PATH, as `source .venv/bin/activate` gives it:
    the tiny model written, the JSONL made, a run of 2 steps prepared, trained, evaluated and
    exported, and `grpo status` reporting it. Against the session's Prefect server (a user's run
    starts an embedded one: the same flow, ~15 s more)."""
    from prefect.settings import PREFECT_API_URL

    blocks = []
    for doc in ("docs/quickstart.md", "README.md"):
        blocks += [b for b in _marked_blocks((ROOT / doc).read_text()) if b not in blocks]
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "HF_HUB_OFFLINE": "1",  # offline, as the block says: nothing may reach for the Hub
        "PYTHONUNBUFFERED": "1",
    }
    for i, block in enumerate(blocks):
        cwd = tmp_path / f"block{i}"
        cwd.mkdir()
        done = _run_block(block, cwd, env, timeout=540)
        assert done.returncode == 0, done.stdout[-6000:]
        summary = json.loads((cwd / "runs" / "quickstart" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 2, summary
        assert (cwd / "runs" / "quickstart" / "export" / "2" / "model.safetensors").exists()
        assert "run " in done.stdout and ": completed" in done.stdout  # grpo status's first line


# -- grpo tiny-model -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_tiny_model_loads_in_transformers_and_here_alike(tmp_path, arch, capsys):
    """`grpo tiny-model DIR`: a Hugging Face folder (no download, no PyTorch needed to write it)
    that transformers loads as the architecture asked for, with the same logits as this project's
    loader (model.path), and a tokenizer that encodes any text."""
    import torch
    import transformers

    from flows.cli import main
    from grpo_core.nn.hf import load_hf_model

    folder = tmp_path / "tiny"
    assert main(["tiny-model", str(folder), "--arch", arch]) == 0
    assert f"--set model.path={folder}" in capsys.readouterr().out
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    text = "Weng earns $12 an hour: ünïcode, 日本, emoji 🙂"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and tok.eos_token == "<|im_end|>" and tok.chat_template
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits.numpy()
    ours = np.asarray(load_hf_model(str(folder))(np.asarray([ids])))
    assert ours.shape == theirs.shape and np.abs(ours - theirs).max() < 1e-4 * np.abs(theirs).max()
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [
        tok.convert_tokens_to_ids("<|im_end|>"),
        tok.convert_tokens_to_ids("<|endoftext|>"),
    ]
