#!/usr/bin/env bash
# Downloads into .whl/ exactly the wheels the lent H200 lacks for scripts/gpu_check.sh, slims
# the three native ones, and checks that the set fits one device call.
#
#   bash scripts/gpu_wheels.sh            # here, on a machine that reaches the package index
#   # then, in the device call: carry [".whl"]; scripts/gpu_check.sh installs them itself
#
# The H200 image (Python 3.12, CUDA 13) already has torch 2.11 (cu130), CuPy cuda13x 14.2,
# cuda-core/cuda-bindings, nvidia-ml-py, numpy, pandas, pyarrow, tokenizers 0.23, safetensors,
# huggingface-hub, click, cloudpickle, fsspec, toolz, pyyaml, jinja2, msgpack, psutil,
# sortedcontainers, prometheus-client (see the device notes' package list). It lacks dask,
# distributed, dask-cuda, UCX and has transformers 5.17 (the runner refuses < 5.24).
#
# The set is what `pip install '.[gpu-cu13]'` resolves to (RAPIDS 26.10: dask == distributed ==
# 2026.7.1, dask-cuda 26.10, distributed-ucxx 0.52, libucx 1.21), minus what the image has:
# found with `pip install --dry-run --report` and each wheel's Requires-Dist. Left out on
# purpose: bokeh (the check runs without a dashboard), rapids-dask-dependency (only pins
# versions; its import patches come through a .pth file that a --target install never runs),
# gguf (SmolLM2 only), cupy/cuda-core (in the image).
#
# Sizes (downloaded 2026-11): ~80 MiB as published, 31 MiB after slimming libucx (static
# archives, perftest, headers, tools), libucxx and librmm (C++ headers), plus ~7 MiB of
# fallback (cuda-core 1.2.2 + cuda-pathfinder, installed only if the image's cuda-core is too old). The device call
# carries at most 64 MiB with the working tree (~3 MiB): one call suffices. If a newer
# libucx or transformers ever pushes it past the limit, split: carry the UCX/RAPIDS wheels
# in one call that installs into /tmp/site and keep the machine warm, then carry the rest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${1:-$ROOT/.whl}"
LIMIT_MIB="${GPU_WHEELS_LIMIT_MIB:-58}"
PY="${PYTHON:-python3}"

WHEELS=(
  dask==2026.7.1
  distributed==2026.7.1
  dask-cuda==26.10.0
  distributed-ucxx-cu13==0.52.0
  ucxx-cu13==0.52.0
  libucxx-cu13==0.52.0
  libucx-cu13==1.21.0
  rmm-cu13==26.10.0
  librmm-cu13==26.10.0
  rapids-logger==0.3.0
  partd==1.4.2
  locket==1.0.0
  tblib==3.2.2
  zict==3.0.0
  tornado==6.6.1
  transformers==5.24.0
  regex==2026.11.19
)

mkdir -p "$DEST"
rm -f "$DEST"/*.whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"

# Fallback, installed by gpu_check.sh only if the image's cuda-core lacks `cuda.core.Device`
# (dask-cuda 26.10 and ucxx need cuda-core >= 0.5.1; the image's version is not recorded).
mkdir -p "$DEST/fallback"
rm -f "$DEST"/fallback/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST/fallback" cuda-core==1.2.2 cuda-pathfinder==1.9.1

# Slim the native wheels: the runtime loads only the shared libraries (and UCX its modules).
"$PY" "$ROOT/scripts/slim_wheel.py" "$DEST"/libucx_cu13-*.whl \
  'libucx/lib/*.a' 'libucx/lib/*.la' 'libucx/lib/*.so.0.0.0' 'libucx/lib/ucx/*.a' 'libucx/lib/ucx/*.la' \
  'libucx/lib/ucx/*.so.0.0.0' 'libucx/lib/ucx/libucx_perftest*' 'libucx/bin/*' 'libucx/include/*' \
  'libucx/share/*' 'libucx/lib/cmake/*' 'libucx/lib/pkgconfig/*'
"$PY" "$ROOT/scripts/slim_wheel.py" "$DEST"/libucxx_cu13-*.whl 'libucxx/include/*' 'libucxx/lib64/cmake/*'
"$PY" "$ROOT/scripts/slim_wheel.py" "$DEST"/librmm_cu13-*.whl 'librmm/include/*' 'librmm/lib64/cmake/*'

count=$(ls "$DEST"/*.whl | wc -l)
bytes=$(du -cb "$DEST"/*.whl "$DEST"/fallback/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu_wheels: $count wheels + $(ls "$DEST"/fallback/*.whl | wc -l) fallback, $mib MiB in $DEST"
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "gpu_wheels: expected ${#WHEELS[@]} wheels, got $count" >&2
  exit 1
fi
if [ "$mib" -gt "$LIMIT_MIB" ]; then
  echo "gpu_wheels: $mib MiB is over the $LIMIT_MIB MiB left for wheels in one device call; split them" >&2
  exit 1
fi
