# The two commands: `make demo` and `make test`. Each creates .venv and installs the project
# (pinned by constraints.txt) on first use, so a fresh machine needs only python3.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench install clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/grpo demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

bench: $(STAMP)  # one after another: each measures this machine, so never two at once
	$(BIN)/python -m bench.grpo_step
	$(BIN)/python -m bench.hf_load
	$(BIN)/python -m bench.generate

clean:
	rm -rf $(VENV) *.egg-info
