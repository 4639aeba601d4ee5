#!/usr/bin/env bash
# Install draftsmith and its dependencies into the current Python environment.
# Without a GPU, torch is pinned to the CPU build first (2.13.0 lies on this project's machines),
# so that the range in pyproject.toml then installs nothing more; GPU users keep their CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if ! "$PYTHON" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        "$PYTHON" -m pip install --quiet "torch>=2.4,<3"
    else
        "$PYTHON" -m pip install --quiet "torch==2.13.0"
    fi
fi
"$PYTHON" -m pip install --quiet -e ".[dev]"
# The export parity tests load exports with vLLM's own `speculators` library. Its metadata pins
# transformers<=5.19 and datasets<=5.1 and asks for torchvision/torchaudio, none of which its EAGLE-3
# model code needs: resolved normally it would downgrade transformers and pull a second torch stack.
# So it goes in without dependencies, with the one it imports unconditionally (hs-connectors, which
# needs only torch and safetensors); loguru and openai come with the dev extras above.
"$PYTHON" -m pip install --quiet --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
