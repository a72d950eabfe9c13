# Sourced by the GPU scripts (run from the repo root on the lent GPU machine): installs the wheels the machine lacks
# (carried in .whl/) and opdispatch itself into /tmp/site, sets $out (results: $OUT or the given default) and $repo,
# moves to /tmp so the installed package is imported, not the checkout's folders, builds the compiled per-call
# fast path (`opdispatch build`, ~18 s: without it every figure measures the Python front door) and records device,
# versions and which fast path is active.
out=${OUT:-$1}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . || exit 1
repo=$(pwd)
cd /tmp
export OPDISPATCH_CACHE_DIR=${OPDISPATCH_CACHE_DIR:-/tmp/opdispatch-cache}
# A figure of the Python door must never pass for one of the compiled door: a failed build stops the run
# (ALLOW_PYTHON_DOOR=1 measures the Python door on purpose, and environment.txt says which one ran).
if ! python3 -c "import sys; from opdispatch.tools import _cli; sys.argv = ['opdispatch', 'build']; sys.exit(_cli.main())" \
  > "$out/build.txt" 2>&1; then
  echo "opdispatch build failed: $(tail -3 "$out/build.txt")"
  [ "${ALLOW_PYTHON_DOOR:-0}" = 1 ] || exit 1
fi
python3 - <<'PY' | tee "$out/environment.txt"
import platform, torch, triton
print("device:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      "triton", triton.__version__, "python", platform.python_version())
from opdispatch.base import _native
print("fast path:", _native.status())
PY
