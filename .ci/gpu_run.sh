#!/usr/bin/env bash
# Runs test and benchmark steps on a lent GPU machine, from the repository root:
#   .ci/gpu_run.sh 'NAME|SECONDS|COMMAND' ...
# Each step runs under `timeout`; its output is appended to $OUT/log.txt (or ./gpu_log.txt
# without $OUT). A table of steps, exit codes, seconds and pytest summaries ends the output.
# In COMMAND, $MPIRUN is Open MPI's mpirun as root with oversubscription (ranks may
# share one GPU). Refuses to start unless NVLink multicast is switched off (gpu_env.sh).
set -u
here=$(cd "$(dirname "$0")" && pwd)
. "$here/gpu_env.sh"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MPIRUN="mpirun --allow-run-as-root --oversubscribe -x PYTHONPATH -x PYTHONUNBUFFERED -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
log=${OUT:-.}/log.txt
summary=()
for step in "$@"; do
    IFS='|' read -r name seconds cmd <<<"$step"
    echo "===== $name ($seconds s): $cmd" >>"$log"
    start=$(date +%s)
    timeout -k 10 "$seconds" bash -c "$cmd" >>"$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    tail=$(tail -n 200 "$log" | grep -E "(passed|failed|error|skipped)( |,|$)" | tail -n 1 | cut -c1-110)
    summary+=("$(printf '%-28s rc=%-3s %5ss  %s' "$name" "$rc" "$took" "$tail")")
done
echo "===== summary"
printf '%s\n' "${summary[@]}"
