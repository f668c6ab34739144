# The two commands: `make demo` and `make test`. Each creates .venv on first use and installs what
# it needs (pinned by constraints.txt), so a fresh machine needs only python3: `make demo` the
# project alone (~2 min here), `make test` adds the dev tools. A stamp per level says what is
# installed, so `make test` after `make demo` installs only the difference.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed-dev

# The sglang-jax rollout environment (train.rollout.engine: sglang, or the sglang-jax servers of the
# http engine): a second virtualenv on Python 3.12, because sglang-jax pins older jax/flax/fastapi
# than the main one holds (requirements-sglang.txt). `make test` builds it so its tests run; on a
# machine without Python 3.12, SGLANG=0 make test skips them. SGLANG_EXTRA=tpu on a TPU VM.
SGL_VENV ?= .venv-sglang
SGL_STAMP := $(SGL_VENV)/.installed
SGLANG ?= 1
SGLANG_EXTRA ?= cpu
# pyenv's 3.12 when there is one (its shims may point elsewhere), else python3.12 on PATH
PYTHON312 ?= $(shell p=$$(pyenv prefix 3.12 2>/dev/null | head -n1); \
	if [ -x "$$p/bin/python3.12" ]; then echo "$$p/bin/python3.12"; else command -v python3.12 2>/dev/null; fi)
SGL_DEP := $(if $(filter 1,$(SGLANG)),$(SGL_STAMP))

.PHONY: demo test test-fast lint bench install clean sglang-env bytecode docs

$(DEMO_STAMP): pyproject.toml constraints.txt scripts/install.sh
	scripts/install.sh $(VENV) $(PYTHON) cpu demo   # the images' recipe too (Dockerfile)
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP)
	scripts/install.sh $(VENV) $(PYTHON) cpu dev
	touch $(STAMP)

install: $(STAMP)

$(SGL_STAMP): requirements-sglang.txt pyproject.toml
	@test -n "$(PYTHON312)" || { echo "the sglang-jax environment needs Python 3.12: 'pyenv install 3.12' or" \
		"PYTHON312=/path/to/python3.12; SGLANG=0 make test skips its tests"; exit 1; }
	@echo "sglang-env: $(SGL_VENV) for the sglang-jax rollout engine (Python 3.12; a few minutes the first time)"
	$(PYTHON312) -m venv $(SGL_VENV)
	$(SGL_VENV)/bin/python -m pip install -q --upgrade pip
	$(SGL_VENV)/bin/python -m pip install --progress-bar off -r requirements-sglang.txt \
		$(if $(filter tpu,$(SGLANG_EXTRA)),"jax[tpu]==0.10.2")
	$(SGL_VENV)/bin/python -m pip install -q --no-deps -e .
	$(SGL_VENV)/bin/python -c "import sgl_jax, grpo_core.engines"
	touch $(SGL_STAMP)

sglang-env: $(SGL_STAMP)

# The project's own modules compiled to bytecode once: the editable install leaves them as sources,
# and where PYTHONDONTWRITEBYTECODE is set every process (each stage's worker, each test's child)
# would compile what it imports again (~0.2 CPU-s a worker). Only what changed is compiled again.
bytecode: $(DEMO_STAMP)
	$(BIN)/python -m compileall -q grpo_core flows tasks bench tests

demo: bytecode
	$(BIN)/grpo demo

# The docs site (mkdocs.yml, docs/) into site/, warnings as errors: a broken link or anchor fails it.
# The config reference is generated from grpo_core/config's declarations while it builds (docs/hooks/).
# mkdocs and its theme come with the dev install ('.[docs]'); an older .venv gets them here.
docs: $(STAMP)
	@$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/python -m pip install -q -c constraints.txt -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The suite in TEST_JOBS processes (pytest-xdist; TEST_JOBS=0: in this one). Many tests wait on the
# processes, servers and polls they start, so more processes than cores overlap those waits, but
# each also starts its own servers and compiles its own programs (docs/development.md: the figures per count).
# Each test module goes whole to one process (its module fixtures set up once), the modules with
# slow tests first (tests/conftest.py).
TEST_JOBS ?= 3
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

test: lint bytecode $(SGL_DEP)
	$(PYTEST) --durations=15  # the slowest tests, named, to keep the suite in budget

test-fast: lint bytecode
	$(PYTEST) -m "not slow"

bench: $(STAMP) bytecode $(SGL_DEP)  # one after another: each measures this machine, so never two at once
	$(BIN)/python -m bench.grpo_step
	$(BIN)/python -m bench.hf_load
	$(BIN)/python -m bench.generate
	$(BIN)/python -m bench.real_shapes
	$(BIN)/python -m bench.rollout_engines
	$(BIN)/python -m bench.start_policy
	$(BIN)/python -m bench.rescore
	$(BIN)/python -m bench.decode_bytes
	$(BIN)/python -m bench.agent_turns

clean:
	rm -rf $(VENV) $(SGL_VENV) *.egg-info
