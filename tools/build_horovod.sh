#!/usr/bin/env bash
# Build (or reuse) a Horovod 0.28.1 wheel with PyTorch + TensorFlow + MPI + Gloo for
# the venv's torch and TF, and install it.
#
# Why: upstream's last release does not build with torch >= 2.1 or TF 2.21. We take the
# registry's sdist, apply tools/horovod-0.28.1-cxx17.patch and build without isolation
# so CMake sees the venv's frameworks. The wheel is cached under
# ${HPCTRAIN_WHEEL_CACHE:-~/.cache/hpctrain/wheels}, keyed by every version the binary
# depends on, so reinstalls take seconds.
#
# Usage: tools/build_horovod.sh PATH/TO/VENV
set -euo pipefail

HOROVOD_VERSION=0.28.1
here=$(cd "$(dirname "$0")" && pwd)
venv=${1:?usage: build_horovod.sh VENV}
py="$venv/bin/python"
patch_file="$here/horovod-$HOROVOD_VERSION-cxx17.patch"

versions=$("$py" - <<'EOF'
import sys
from importlib.metadata import version
print(f"torch{version('torch')}-tf{version('tensorflow-cpu')}-py{sys.version_info[0]}{sys.version_info[1]}")
EOF
)
patch_sum=$(sha256sum "$patch_file" | cut -c1-12)
key="horovod$HOROVOD_VERSION-$versions-$patch_sum"
cache_root=${HPCTRAIN_WHEEL_CACHE:-$HOME/.cache/hpctrain/wheels}
cache="$cache_root/$key"

installed_key_file="$venv/.horovod-build-key"
if [ -f "$installed_key_file" ] && [ "$(cat "$installed_key_file")" = "$key" ] \
   && "$py" -c "import horovod.torch, horovod.tensorflow" 2>/dev/null; then
    echo "[build_horovod] Horovod $HOROVOD_VERSION already installed ($key)"
    exit 0
fi

if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
    echo "[build_horovod] no cached wheel for $key: building (about 4 minutes on 2 cores)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$venv/bin/pip" download --quiet --no-deps --no-binary :all: \
        "horovod==$HOROVOD_VERSION" -d "$work" 2>&1 | grep -v '^WARNING: Location' || true
    tar xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
    (cd "$work/horovod-$HOROVOD_VERSION" && patch -p1 --quiet < "$patch_file")
    mkdir -p "$work/dist"
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
    HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
        "$venv/bin/pip" wheel --quiet --no-build-isolation --no-deps \
        -w "$work/dist" "$work/horovod-$HOROVOD_VERSION" > "$work/build.log" 2>&1 || {
            tail -n 60 "$work/build.log" >&2
            echo "[build_horovod] Horovod build failed; full log above (last 60 lines)" >&2
            exit 1
        }
    mkdir -p "$cache"
    cp "$work"/dist/horovod-*.whl "$cache/"
fi

"$venv/bin/pip" install --quiet --no-deps --force-reinstall "$cache"/horovod-*.whl
echo "$key" > "$installed_key_file"
echo "[build_horovod] installed Horovod from $cache"
