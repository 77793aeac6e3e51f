# Two commands on a fresh machine:  make run  |  make test
# Both create .venv on first use (CPU build of torch where there is no CUDA), then reuse it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH_CPU := torch==2.13.0

.PHONY: run test venv lint clean-venv

run: $(STAMP)
	$(BIN)/harness run

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "CUDA found: installing the default torch build"; \
	else \
		echo "no CUDA: installing the CPU build $(TORCH_CPU) first"; \
		$(BIN)/pip install -q $(TORCH_CPU) || exit 1; \
	fi
	$(BIN)/pip install -q numpy
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)
