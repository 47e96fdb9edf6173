#!/usr/bin/env bash
# The device check for GPU targets (one command, no downloads, < 8 minutes on an H200):
# run the CUDA-only tests when pytest is there, build h200-sdxl-random (UNet at 1024x1024, VAE decoder;
# bf16 + fused QKV, max-autotune off, CUDA graphs checked), then bench eager / compile / aot (graphs)
# / aot without graphs and copy the manifest and bench JSON to $OUT.
# CHECK=regional instead: h200-flux-random (full-size Flux, random weights, CUDA graphs) built whole and
# with [compile] mode = "regional", both timed afresh, then bench aot vs aot-regional: the regional table
# (build time, package bytes, first image, steady step) and both manifests. TARGET=h200-wan-random
# makes either check a video one: a Wan 2.1 14B-shaped transformer (40 blocks), 17 frames at 480x832.
# Where the device lacks diffusers/transformers/..., carry wheels in .whl/: `make device-wheels`
# writes them, and the device tool's run takes carry=[".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
CHECK=${CHECK:-whole}
if [ "$CHECK" = regional ]; then TARGET=${TARGET:-h200-flux-random}; else TARGET=${TARGET:-h200-sdxl-random}; fi
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m aotbuild.cli targets | grep "^$TARGET "
tests_rc=0
if python3 -c "import pytest" 2>/dev/null; then   # a failure fails the check, after the figures below are taken
  python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_optimize.py -k "cuda or graph or gpu" 2>&1 \
    | tee "$OUT/pytest.log" | tail -5 || tests_rc=${PIPESTATUS[0]}
fi
finish() {  # the check's exit code: the CUDA tests' when they failed
  if [ "$tests_rc" != 0 ]; then echo "CUDA tests failed (exit $tests_rc): see $OUT/pytest.log" >&2; fi
  exit "$tests_rc"
}
if [ "$CHECK" = regional ]; then
  python3 -m aotbuild.cli bench --target "$TARGET" --artifacts "$OUT/artifacts" --cases aot,aot-regional \
    --repeats "${REPEATS:-1}" --steps "${STEPS:-4}" --steady 2 2>&1 | tee "$OUT/bench.log"
  cp "$OUT/artifacts/$TARGET/manifest.json" "$OUT/manifest-whole.json"
  cp "$OUT/artifacts/$TARGET-regional/manifest.json" "$OUT/manifest-regional.json"
  cp "$OUT/artifacts/$TARGET/bench.json" "$OUT/bench.json"
  rm -rf "$OUT/artifacts"
  finish
fi
( time python3 -m aotbuild.cli build --target "$TARGET" --artifacts "$OUT/artifacts" ) 2>&1 | tee "$OUT/build.log"
python3 -m aotbuild.cli bench --target "$TARGET" --artifacts "$OUT/artifacts" --cases eager,compile,aot,aot-no-cuda-graphs \
  --repeats "${REPEATS:-1}" --steps "${STEPS:-4}" --steady 2 2>&1 | tee "$OUT/bench.log"
cp "$OUT/artifacts/$TARGET/manifest.json" "$OUT/manifest.json"
cp "$OUT/artifacts/$TARGET/bench.json" "$OUT/bench.json"
du -sh "$OUT/artifacts/$TARGET" | tee -a "$OUT/bench.log"
rm -rf "$OUT/artifacts"   # too big to bring back; the figures are in the JSON
finish
