# Sourced first by every script that runs ubnext on a GPU machine: refuses to go on
# unless NVLink multicast is switched off the way the shared hosts require it, and checks
# that ubnext's own gate leaves it off (UBNEXT_NVLS must not opt in there). Run as a
# script (`bash .ci/gpu_env.sh`, as .ci/gpu_suite.py does) it exits 3 on refusal, 0 otherwise.
ubnext_require_multicast_off() {
    local bad=""
    [ "${NCCL_NVLS_ENABLE-}" = "0" ] || bad="$bad NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-<unset>}"
    [ "${TORCH_SYMM_MEM_DISABLE_MULTICAST-}" = "1" ] || bad="$bad TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST-<unset>}"
    [ "${NVSHMEM_DISABLE_NVLS-}" = "1" ] || bad="$bad NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS-<unset>}"
    [ "${UBNEXT_NVLS-auto}" != "1" ] || bad="$bad UBNEXT_NVLS=1"
    if [ -n "$bad" ]; then
        echo "refusing to run: NVLink multicast must stay off on this machine:$bad" >&2
        return 1
    fi
}
ubnext_require_multicast_off || exit 3
