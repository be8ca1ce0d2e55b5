# Two commands for a new user: `make demo` and `make test` (and `make play` to play in a browser). Both create .venv if
# missing and install what is needed first. torch is pinned and installed before anything else, from pip's default
# index: on Linux that is the CUDA build (several GB), with or without a GPU. For the CPU wheel, install it into
# .venv first (pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu): make keeps it.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0

.PHONY: demo demo-synthetic play test test-fast lint bench golden clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[server,video,plot,dev,web,browser]"
	touch $(STAMP)

# First what a newcomer should see: the synthetic backend, whose frames follow the camera keys (out/demo.mp4). Then,
# as its own plainly named proof, the real model path (umT5, VAE, DiT over 5 ranks) with tiny random weights: its
# video is noise by design (out/model-path-random-weights.mp4).
demo: $(STAMP)
	$(PY) scripts/demo.py --config cpu-tiny --out out/demo.mp4 --json out/demo.json
	$(PY) scripts/demo.py --config cpu-tiny-model --out out/model-path-random-weights.mp4 \
		--json out/model-path-random-weights.json

demo-synthetic: $(STAMP)
	$(PY) scripts/demo.py --config cpu-tiny --out out/demo.mp4 --json out/demo.json

# The 7-rank CPU server and the web gateway; prints the page's URL (Ctrl-C stops both).
play: $(STAMP)
	$(PY) scripts/play.py

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not multiprocess"

lint: $(STAMP)
	$(PY) -m ruff check .

golden: $(STAMP)
	$(PY) scripts/check_golden.py --all

bench: $(STAMP)
	$(PY) scripts/bench_schedule.py

clean:
	rm -rf out .pytest_cache
