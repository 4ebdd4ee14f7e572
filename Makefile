# kvgate: one entry point for setup, the demo, tests and checks (the same locally and in CI).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
APT_PACKAGES := nginx-light libnginx-mod-http-lua lua-resty-core lua-resty-lrucache lua-cjson \
                redis-server lua-check prometheus docker-compose python3-venv
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

VLLM_VENV := .vllm-venv
VLLM_MODEL := .vllm-model

.PHONY: setup demo test test-docker test-real real-vllm check fmt clean

setup: .setup-apt.stamp $(VENV)/.installed

# System packages: Nginx with the Lua module, Redis, luacheck, promtool, docker-compose (validates
# the compose files; no engine needed). Quiet when already there.
.setup-apt.stamp: Makefile
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		echo "installing system packages: $(APT_PACKAGES)"; \
		$(SUDO) apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends $(APT_PACKAGES) >/dev/null; \
	fi
	@touch $@

$(VENV)/.installed: pyproject.toml
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip 2>/dev/null
	@$(PY) -m pip install -q -e '.[dev,bench]'
	@touch $@

# The demo's simulators share the host's cores with the gateway: the gateway goes first (a user who
# may not raise priority gets one warning, and the stack runs as started).
demo: setup
	$(VENV)/bin/kvgate up --gateway-nice -10

test: setup
	$(PY) -m pytest

check: setup
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	luacheck --std ngx_lua --codes lua/ kvgate_bench/phases.lua

fmt: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# A real vLLM (CPU build) in its own virtualenv, and the tiny model it serves, built from code.
real-vllm: $(VLLM_VENV)/.installed $(VLLM_MODEL)/MANIFEST

$(VLLM_VENV)/.installed: vllm_real/install.sh
	@vllm_real/install.sh $(VLLM_VENV)
	@touch $@

$(VLLM_MODEL)/MANIFEST: vllm_real/model.py $(VLLM_VENV)/.installed
	@$(VLLM_VENV)/bin/python vllm_real/model.py --out $(VLLM_MODEL)

# The end-to-end suite against real vLLM servers (tests/real; run by CI after `make test`).
test-real: setup real-vllm
	$(PY) -m pytest -m real -rP tests/real

clean:
	rm -rf .run .setup-apt.stamp $(VENV) *.egg-info

# Container tests (testcontainers) need a Docker engine; they are not part of `make test`.
test-docker: setup
	$(PY) -m pytest -m docker
