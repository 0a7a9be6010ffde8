#!/usr/bin/env bash
# Runs COMMAND as an Open MPI rank that sees only its own GPU, the layout that
# `srun --gpus-per-task=1` gives:  .ci/own_gpu.sh GPU_LIST COMMAND [ARG...]
# The rank's index on the node (OMPI_COMM_WORLD_LOCAL_RANK) picks its entry of the
# comma-separated GPU_LIST (e.g. 0,1,2,3), which becomes CUDA_VISIBLE_DEVICES.
set -eu
IFS=, read -ra gpus <<<"$1"
shift
rank=${OMPI_COMM_WORLD_LOCAL_RANK:?own_gpu.sh: OMPI_COMM_WORLD_LOCAL_RANK is unset (run it under Open MPI mpirun)}
if (( rank >= ${#gpus[@]} )); then
    echo "own_gpu.sh: local rank $rank, but the GPU list has ${#gpus[@]} entries" >&2
    exit 2
fi
export CUDA_VISIBLE_DEVICES=${gpus[rank]}
exec "$@"
