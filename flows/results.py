"""A run as Python sees it (what `flows.notebook.train` returns, or `Run.open(...)` of any run
folder): what `grpo status` knows, read from the run root each time it is asked: the summary, the
metrics as a pandas table, the evaluations, the export's path, the curve, and the exported policy
loaded with transformers (or as this project's JAX model).

Reads storage only; pandas, IPython, transformers and JAX are imported by the method that needs
each. The Prefect side never imports JAX: `load_jax_model` is the one exception, made only when
called, and on a TPU the process that calls it holds the chips until it exits (libtpu belongs to
one process), so a notebook calls it after its last training run.
"""

from __future__ import annotations

import os
from typing import Any

from grpo_core.config.run import load_config
from grpo_core.store.report import eval_results, latest_export, plot_curve, status
from grpo_core.store.root import RunRoot


class Run:
    """One run's folder: `url` (storage.root/run_name), and what it holds."""

    def __init__(self, url: str, summary: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        self._returned = summary  # what the flow returned, before summary.json is read back

    @classmethod
    def open(cls, run: str, storage_root: str | None = None) -> "Run":
        """A run by its folder or URL, or by its name under `storage_root` (default: the config's, ./runs)."""
        if "://" in run or os.sep in run or run.startswith("."):
            url = run if "://" in run else os.path.abspath(run)
        else:
            sets = [f"storage.root={storage_root}"] if storage_root else []
            url = load_config(None, [*sets, f"run_name={run}"]).run_url
        if not RunRoot(url).exists("config.json"):
            raise FileNotFoundError(f"{url} is not a run: it has no config.json")
        return cls(url)

    @property
    def root(self) -> RunRoot:
        return RunRoot(self.url)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def summary(self) -> dict[str, Any] | None:
        """summary.json: status, steps, training reward first and last, eval before and after, timing."""
        root = self.root
        return root.read_json("summary.json") if root.exists("summary.json") else self._returned

    def status(self) -> dict[str, Any]:
        """What `grpo status RUN --json` prints: steps done, checkpoints, stages done, evaluations."""
        return status(self.root)

    @property
    def metrics(self):
        """Every training step's metrics (reward, each reward function's rewards/{name}/mean, kl,
        entropy, timings, ...) as a pandas DataFrame, one row per step."""
        import pandas as pd  # heavy (~0.5 s): only the table needs it

        table = pd.DataFrame(self.root.read_metrics())
        if "step" in table:  # stored as JSON numbers: the step a whole one again, first
            table.insert(0, "step", table.pop("step").astype(int))
        return table

    @property
    def evals(self) -> list[dict[str, Any]]:
        """eval/{step}.json of every evaluated step (0: the starting policy), by step: accuracy,
        pass@k, the reward means, a few held-out completions (`examples`)."""
        return eval_results(self.root)

    @property
    def eval_table(self):
        """The evaluations' numbers as a pandas DataFrame, one row per evaluated step."""
        import pandas as pd  # heavy (~0.5 s): only the table needs it

        rows = []
        for e in self.evals:
            row = {"step": e["step"], **{k: v for k, v in e.items() if k == "accuracy" or k.startswith("pass@")}}
            for kind in ("greedy", "sampled"):
                for k, v in (e.get(kind) or {}).items():
                    if isinstance(v, (int, float)):
                        row[f"{kind}/{k}"] = v
            rows.append(row)
        return pd.DataFrame(rows)

    @property
    def export_path(self) -> str | None:
        """The newest Hugging Face export (export/{step}/: safetensors, config, tokenizer), or None."""
        return latest_export(self.root)

    def plot(self):
        """The training reward and eval accuracy against steps, drawn from the run root now: an
        IPython Image (a notebook shows it inline), or the PNG's bytes outside IPython."""
        png = plot_curve(self.root)
        if png is None:
            raise FileNotFoundError(f"{self.url} has no metrics or evaluations to draw yet")
        try:
            from IPython import get_ipython  # optional: present in a notebook's kernel
            from IPython.display import Image  # optional, as above
        except ImportError:
            return png
        if get_ipython() is None:  # IPython installed, this a plain script: the bytes, as said
            return png
        return Image(data=png, format="png")

    def _local_export(self) -> str:
        """A local folder of the newest export (a gs:// one copied into the model cache)."""
        from grpo_core.store.sources import resolve  # heavy-ish (huggingface_hub): only a load needs it

        if self.export_path is None:
            raise FileNotFoundError(f"{self.url} has no export yet (pipeline.export writes one at the end of training)")
        return resolve(self.export_path)

    def load_model(self, **kwargs: Any):
        """The exported policy as `transformers.AutoModelForCausalLM.from_pretrained(export_path,
        **kwargs)` (PyTorch; `pip install torch` where it is missing)."""
        from transformers import AutoModelForCausalLM  # heavy (~2 s, PyTorch): only a load needs it

        return AutoModelForCausalLM.from_pretrained(self._local_export(), **kwargs)

    def load_tokenizer(self, **kwargs: Any):
        """The export's tokenizer, `transformers.AutoTokenizer.from_pretrained(export_path)`."""
        from transformers import AutoTokenizer  # heavy (~2 s): only a load needs it

        return AutoTokenizer.from_pretrained(self._local_export(), **kwargs)

    def load_jax_model(self, dtype: str | None = None):
        """The exported policy as this project's Flax NNX model (grpo_core.nn.hf.load_hf_model).
        This process then holds the accelerator: see the module's doc."""
        from grpo_core.nn.hf import load_hf_model  # JAX, only when asked: the Prefect side never imports it

        return load_hf_model(self._local_export(), dtype=dtype)

    def __repr__(self) -> str:
        s = self.summary or {}
        return f"Run({self.url!r}, status={s.get('status', 'in progress or stopped')!r}, steps={s.get('steps')})"

    def _repr_markdown_(self) -> str:
        s = self.summary or {}
        lines = [f"**GRPO run** `{self.url}`: {s.get('status', 'in progress or stopped')}, {s.get('steps')} steps"]
        if s.get("reward_mean_first") is not None:
            lines.append(f"- training reward {s['reward_mean_first']:.3f} → {s['reward_mean_last']:.3f}")
        before, after = s.get("eval_before") or {}, s.get("eval_after") or {}
        if after.get("accuracy") is not None:
            lines.append(f"- eval accuracy {before.get('accuracy', float('nan')):.3f} → {after['accuracy']:.3f}")
        if s.get("export_uri"):
            lines.append(f"- Hugging Face export `{s['export_uri']}` (`run.load_model()`)")
        return "\n".join(lines)
