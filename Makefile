# pansketch: the two commands of the README, and their setup.
PYTHON ?= python3
PIP ?= $(PYTHON) -m pip

.PHONY: setup demo test bench clean

# Python packages (editable install with test extras) and the MicroPython
# WebAssembly VM used by the device tests (npm, pinned in tests/mpnode).
setup:
	$(PIP) install -q -e ".[test,repro]"
	cd tests/mpnode && npm install --no-audit --no-fund --silent

# The demo uses mosquitto when installed, else the pure-Python amqtt broker.
demo: setup
	command -v mosquitto >/dev/null || [ -x /usr/sbin/mosquitto ] || $(PIP) install -q -e ".[demo]"
	pansketch demo

test: setup
	$(PYTHON) -m pytest -q

bench: setup
	$(PYTHON) -m host_tools.bench_core

clean:
	rm -rf bench-results .pytest_cache
