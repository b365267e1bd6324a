#!/usr/bin/env bash
# Install the whole hpctrain stack from nothing on Debian 12, idempotently:
# system Open MPI, a .venv with pinned torch/TF/h5py/..., mpi4py compiled against the
# system MPI, a patched Horovod (tools/build_horovod.sh) and hpctrain itself in editable
# mode. Ends by checking itself. `--test` (make test) adds what only the test suite
# needs: SLURM's daemons with munge (the SLURM tests start their own) and shellcheck;
# training never needs them, so `make demo` does not install system daemons.
#
# A second run skips every step whose result is already there (under a minute).
set -euo pipefail
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-2}

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv="$root/.venv"
PYTHON=${PYTHON:-python3}
MPI4PY_VERSION=4.1.2
log() { printf '[install] %s\n' "$*"; }

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

# --- 1. System packages ------------------------------------------------------------
apt_packages=(openmpi-bin libopenmpi-dev build-essential cmake pkg-config patch
              iproute2)  # ip and tc: the emulated cluster (hpctrain cluster, multi-node tests)
if [ "${1:-}" = "--test" ]; then
    apt_packages+=(slurmctld slurmd slurm-client munge slurm-wlm-basic-plugins shellcheck)
fi
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" > /dev/null
else
    log "system packages present"
fi

# --- 2. Virtual environment with pinned packages -----------------------------------
if [ ! -x "$venv/bin/python" ]; then
    log "creating $venv"
    "$PYTHON" -m venv "$venv"
fi
pip=("$venv/bin/pip" --disable-pip-version-check --quiet)
req_stamp="$venv/.requirements.sha256"
req_sum=$(cat tools/requirements.txt setup.cfg | sha256sum | cut -d' ' -f1)
if [ ! -f "$req_stamp" ] || [ "$(cat "$req_stamp")" != "$req_sum" ]; then
    log "pip install -r tools/requirements.txt"
    "${pip[@]}" install -r tools/requirements.txt 2>&1 | grep -v '^WARNING: Location' || true
    "$venv/bin/python" -c "import torch, tensorflow, h5py, numpy, xxhash" \
        || { echo "[install] pinned packages failed to import" >&2; exit 1; }
    echo "$req_sum" > "$req_stamp"
else
    log "pinned packages present"
fi

# mpi4py compiled against the system Open MPI (pip caches the built wheel).
if ! "$venv/bin/python" - "$MPI4PY_VERSION" <<'EOF' 2>/dev/null
import sys, mpi4py
from mpi4py import MPI
assert mpi4py.__version__ == sys.argv[1]
assert "Open MPI" in MPI.Get_library_version()
EOF
then
    log "building mpi4py $MPI4PY_VERSION against the system MPI (about 3 minutes)"
    "${pip[@]}" install --no-binary mpi4py "mpi4py==$MPI4PY_VERSION" 2>&1 | grep -v '^WARNING: Location' || true
else
    log "mpi4py $MPI4PY_VERSION present"
fi

# --- 3. Horovod ---------------------------------------------------------------------
bash tools/build_horovod.sh "$venv"

# --- 4. hpctrain itself, editable ----------------------------------------------------
if ! "$venv/bin/python" -c "import hpctrain" 2>/dev/null || [ ! -x "$venv/bin/hpctrain" ]; then
    log "pip install -e ."
    "${pip[@]}" install --no-deps --no-build-isolation -e . 2>&1 | grep -v '^WARNING: Location' || true
fi

# --- 5. Check ------------------------------------------------------------------------
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# `horovodrun --check-build` imports both frameworks (about 30 s): done again only when
# the pinned packages or the Horovod build changed since it last passed.
hvd_stamp="$venv/.horovod-check"
hvd_key="$req_sum $(stat -c %Y "$venv"/lib/python3*/site-packages/horovod 2>/dev/null)"
if [ -f "$hvd_stamp" ] && [ "$(cat "$hvd_stamp")" = "$hvd_key" ]; then
    log "horovodrun --check-build passed before (same packages and build)"
else
    check=$(TF_CPP_MIN_LOG_LEVEL=3 "$venv/bin/horovodrun" --check-build 2>/dev/null)
    for part in PyTorch TensorFlow MPI Gloo; do
        grep -q "\[X\] $part" <<<"$check" || { echo "$check" >&2; echo "[install] Horovod lacks $part" >&2; exit 1; }
    done
    log "horovodrun --check-build: PyTorch, TensorFlow, MPI, Gloo"
    echo "$hvd_key" >"$hvd_stamp"
fi
"$venv/bin/hpctrain" doctor --quiet
log "done"
