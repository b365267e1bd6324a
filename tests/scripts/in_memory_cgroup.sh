#!/bin/sh
# Usage: in_memory_cgroup.sh DIR LIMIT_BYTES COMMAND...
# Put this rank (OMPI_COMM_WORLD_RANK) in its own memory cgroup DIR/rankN limited to
# LIMIT_BYTES (swap included), then exec COMMAND: the kernel enforces the limit as a
# SLURM cgroup or a container would.
set -e
dir="$1/rank${OMPI_COMM_WORLD_RANK:-0}"
limit="$2"
shift 2
mkdir -p "$dir"
if [ -e "$dir/memory.limit_in_bytes" ]; then  # cgroup v1
    echo "$limit" >"$dir/memory.limit_in_bytes"
    if [ -e "$dir/memory.memsw.limit_in_bytes" ]; then
        echo "$limit" >"$dir/memory.memsw.limit_in_bytes"
    fi
else  # cgroup v2
    echo "$limit" >"$dir/memory.max"
    if [ -e "$dir/memory.swap.max" ]; then echo 0 >"$dir/memory.swap.max"; fi
fi
echo $$ >"$dir/cgroup.procs"
exec "$@"
