# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.draftsmith-core-installed
CORES ?= all
# GPU cap for Snakemake's scheduler: GPU jobs run one per GPU (each pins its own; see draftsmith/gpus.py)
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
PYTEST_ARGS ?=

.PHONY: install demo test lint dryrun clean-results

$(STAMP): envs/core.lock.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r envs/core.lock.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP)

# The real vLLM 0.16.0 Python package (CPU, --no-deps) for the contract tests of the compatibility layer.
CONTRACT_STAMP := $(VENV)/.draftsmith-contract-installed
$(CONTRACT_STAMP): $(STAMP) envs/contract.txt
	$(BIN)/python -m pip install -q --no-deps -r envs/contract.txt
	touch $@

demo: install
	$(BIN)/snakemake --cores $(CORES) --resources gpu=$(GPUS)
	@echo "Report: results/report/report.html (summary: results/report/report.md)"

# pytest exits 5 when it collected no tests: that is a failure too.
test: install $(CONTRACT_STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: install
	$(BIN)/snakemake --lint

dryrun: install
	$(BIN)/snakemake -n

clean-results:
	rm -rf results/* .snakemake logs benchmarks && touch results/.gitkeep
