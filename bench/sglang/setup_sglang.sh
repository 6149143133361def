#!/usr/bin/env bash
# Builds the throwaway environment in which `kvsieve bench radix` runs SGLang's RadixCache and
# `kvsieve bench sglang` / tests/test_sglang_hicache.py run kvsieve as SGLang's HiCache storage.
#
#   bash bench/sglang/setup_sglang.sh [DIR]     (default ~/.cache/kvsieve/sglang-venv; ~2.5 GB, a few minutes)
#
# Never kvsieve's own venv (.ci/run builds this one beside it when missing): sglang pins a
# newer (CUDA) torch, so it is installed with --no-deps next to the CPU torch==2.13.0, plus
# exactly what importing
# sglang.srt.mem_cache.radix_cache needs (found by importing it until it succeeded),
# every one with --no-deps so that nothing can pull another torch. Versions are pinned.
set -euo pipefail
dir="${1:-$HOME/.cache/kvsieve/sglang-venv}"
python3 -m venv "$dir"
pip=("$dir/bin/pip" install -q --disable-pip-version-check --no-deps)
"${pip[@]}" torch==2.13.0+cpu sglang==0.5.23  # +cpu: fail rather than fetch a CUDA build
"${pip[@]}" \
  aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-types==0.8.0 anyio==4.16.0 \
  apache-tvm-ffi==0.1.15.post2 attrs==26.1.0 certifi==2026.10.18 compressed-tensors==0.20.0 dill==0.4.1 \
  filelock==4.2.11 frozenlist==1.8.0 fsspec==2026.9.0 gguf==0.19.0 h11==0.16.0 httpcore2==2.16.2 \
  httpx2==2.16.2 huggingface_hub==2.4.0 idna==3.20 ipython==9.18.1 Jinja2==3.1.6 loguru==0.7.3 \
  MarkupSafe==3.0.4 mpmath==1.3.0 msgspec==0.22.0 multidict==7.2.1 networkx==3.6.1 numpy==2.4.6 \
  orjson==3.13.0 packaging==26.3 pillow==13.0.0 propcache==0.5.4 psutil==7.2.2 pybase64==1.5.1 \
  pydantic==2.14.3 pydantic_core==2.50.4 Pygments==2.21.0 PyYAML==6.0.3 pyzmq==27.3.0 \
  regex==2026.11.15 requests==2.34.2 safetensors==0.8.0 sentencepiece==0.2.3 starlette==1.10.0 \
  sympy==1.14.0 tokenizers==0.23.3 torchvision==0.28.0 tqdm==4.70.1 traitlets==5.16.1 \
  transformers==5.23.0 triton==3.9.0 truststore==0.10.5 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 urllib3==2.8.0 yarl==1.25.1
# A CUDA torch here would be a multi-GB mistake: refuse rather than go on with it.
"$dir/bin/python" - <<'EOF'
import torch
assert torch.__version__ == "2.13.0+cpu", f"expected the CPU torch 2.13.0, got {torch.__version__}"
EOF
"$dir/bin/python" "$(dirname "$0")/radix_driver.py" --check
# kvsieve's SGLang HiCache backend (docs/sglang.md) runs in this environment: kvsieve's client
# needs grpcio, protobuf and xxhash beside SGLang's numpy (pinned, --no-deps as above), and the
# checkout on sys.path (a .pth file: what an editable install amounts to, with no build step
# that could pull a build backend). The sidecar itself always runs in kvsieve's own venv.
"${pip[@]}" grpcio==1.85.3 protobuf==7.36.2 xxhash==4.1.0
repo="$(cd "$(dirname "$0")/../.." && pwd)"
"$dir/bin/python" -c 'import site, sys; print(site.getsitepackages()[0])' | {
  read -r site_dir
  echo "$repo" > "$site_dir/kvsieve-checkout.pth"
}
"$dir/bin/python" "$(dirname "$0")/hicache_driver.py" --check
echo "SGLang environment ready: $dir"
