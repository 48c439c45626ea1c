# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.draftsmith-core-installed
CORES ?= all
PYTEST_ARGS ?=

.PHONY: install demo test lint dryrun clean-results

$(STAMP): envs/core.lock.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r envs/core.lock.txt
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP)

demo: install
	$(BIN)/snakemake --cores $(CORES)
	@echo "Report: results/report/report.html (summary: results/report/report.md)"

# pytest exits 5 when it collected no tests: that is a failure too.
test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: install
	$(BIN)/snakemake --lint

dryrun: install
	$(BIN)/snakemake -n

clean-results:
	rm -rf results/* .snakemake logs benchmarks && touch results/.gitkeep
