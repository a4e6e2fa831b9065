# The two commands: `make demo` and `make test`. Both create .venv and install what they need, once.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# On this CPU machine torch==2.13.0 resolves to the local CPU build; on a Linux GPU box the same pin
# takes PyPI's CUDA build. Any other torch: `make install TORCH='torch==2.x.y'`.
TORCH  ?= torch==2.13.0

.PHONY: install install-test demo test quick clean

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test $(VENV)/.installed-compose $(VENV)/.installed-browser $(VENV)/.installed-kube

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

# docker-compose v1 (PyPI's 1.29.2) checks docker-compose.yml without a Docker engine (tests/test_ops.py). It
# pins PyYAML<6 and jsonschema<4, so it lives in a venv of its own; PyYAML 5.4 builds only with Cython<3.
$(VENV)/.installed-compose:
	test -x $(VENV)/compose/bin/python || $(PYTHON) -m venv $(VENV)/compose
	$(VENV)/compose/bin/python -m pip install -q "cython<3" wheel setuptools
	$(VENV)/compose/bin/python -m pip install -q --no-build-isolation "PyYAML==5.4.1"
	$(VENV)/compose/bin/python -m pip install -q "docker-compose==1.29.2"
	touch $@

# Headless Chromium and its driver for tests/test_ui.py (the web page, driven by selenium): Debian's packages,
# since nothing may be downloaded at test time.
$(VENV)/.installed-browser: $(VENV)/.installed-test
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver)
	touch $@

# kubectl, whose built-in kustomize renders deploy/kubernetes for tests/test_kubernetes.py: Debian's
# kubernetes-client (kubectl 1.20, kustomize 2.0.3, which the manifests are written for) where none is installed.
$(VENV)/.installed-kube: $(VENV)/.installed-test
	command -v kubectl >/dev/null || \
		(apt-get update && apt-get install -y --no-install-recommends kubernetes-client)
	touch $@

demo: install
	HF_HUB_OFFLINE=1 $(BIN)/replicadp demo

# pytest-xdist workers. The suite mostly waits (replicas loading, requests that last a set time): measured on
# 2 cores, one process kept 0.57 of one core busy. A file's tests stay on one worker (--dist loadfile), so its
# module-scoped replicas start once. --no-loadscope-reorder: the files go out in the order conftest.py sorts them
# (longest first), not xdist's (most tests first), so that no long file starts last.
TEST_WORKERS ?= 4

test: install-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The inner loop: every test that starts no replica (validation, schema, units, messages), in under a minute.
quick: install-test
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -m "not cluster" -n 2 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) outputs .pytest_cache
