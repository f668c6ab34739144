"""Prefect flows and the `grpo` command line (flows/cli.py); `from flows import train` runs the
pipeline from Python, a notebook's cell say (flows/notebook.py), and returns a `Run` (flows/results.py)."""

__all__ = ["Run", "train"]


def __getattr__(name: str):
    # On first use: `grpo --help` imports this package and must load the standard library alone.
    if name in __all__:
        from flows import notebook  # Prefect's side, loaded when the API is first named

        return getattr(notebook, name)
    raise AttributeError(f"module 'flows' has no attribute {name!r}")
