#!/usr/bin/env bash
# NCCL's expert-parallel library (nccl_ep: the nccl-extensions wheel) for bench/moe_perf.py's
# nccl_ep baseline, on a GPU host without network whose files arrive at most ~45 MB per call.
#
#   bench/install_nccl_ep.sh pack           # here, with the registry: batches under .whl/nccl_ep
#                                           #   (git-ignored), each under 45 MB: batch0 the small
#                                           #   wheels, batch1.. a part each of the xz'd NCCL wheel
#   bench/install_nccl_ep.sh stash batchN   # GPU host, one call per batch, carrying
#                                           #   .whl/nccl_ep/batchN: copies it under /root/nccl_ep_parts
#   bench/install_nccl_ep.sh install        # GPU host, when every batch is stashed: joins the parts,
#                                           #   checks the sha256, pip install --no-deps --target
#   eval "$(bench/install_nccl_ep.sh env)"  # GPU host: PYTHONPATH and LD_PRELOAD for moe_perf
#
# The wheels (Python 3.12, x86_64, CUDA 13: the GPU host's): nccl-extensions 0.1.0 (nccl.ep),
# nccl4py 0.6.0 (nccl.core: the communicator nccl_ep is created on), cuda-core ~= 1.0 and
# cuda-pathfinder (nccl4py's), nvidia-nccl-cu13 2.30.7 (nccl_ep needs NCCL >= 2.30.7; the
# host's torch brings 2.28.9). They go into a target directory put first on PYTHONPATH, and
# the new libnccl.so.2 is preloaded: libnccl_ep.so binds libnccl.so.2 by name, so without
# the preload it would bind torch's older one (moe_perf's nccl_ep_problem checks which
# libnccl is loaded, and that only one is). torch.distributed then runs on NCCL 2.30.7 too:
# the nccl baseline's figures of such a run are 2.30.7's.
# Every step can be run again; the parts are joined in name order.
set -euo pipefail

DIR=${NCCL_EP_DIR:-.whl/nccl_ep}             # relative to the repository root (carry it)
STASH=${NCCL_EP_STASH:-/root/nccl_ep_parts}
TARGET=${NCCL_EP_TARGET:-/root/nccl_ep}
NCCL_WHEEL=nvidia_nccl_cu13-2.30.7-py3-none-manylinux_2_18_x86_64.whl
PART_BYTES=45000000
PY="--python-version 3.12 --implementation cp --abi cp312 --only-binary=:all:"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64"

case "${1:-}" in
pack)
    mkdir -p "$DIR"
    # shellcheck disable=SC2086
    pip download --no-deps -d "$DIR/batch0" $PY $PLATFORMS "nccl-extensions==0.1.0" "nccl4py==0.6.0" "cuda-core~=1.0" \
        "cuda-pathfinder>=1.5.4,<2"
    # shellcheck disable=SC2086
    pip download --no-deps -d "$DIR/big" $PY $PLATFORMS "nvidia-nccl-cu13==2.30.7"
    (cd "$DIR/big" && sha256sum "$NCCL_WHEEL" > "../batch0/$NCCL_WHEEL.sha256")
    xz -T2 -6 -c "$DIR/big/$NCCL_WHEEL" | split -b "$PART_BYTES" -d -a 2 - "$DIR/big/$NCCL_WHEEL.xz.part"
    n=0
    for part in "$DIR"/big/*.xz.part*; do
        n=$((n + 1))
        mkdir -p "$DIR/batch$n"
        mv "$part" "$DIR/batch$n/"
    done
    rm -r "$DIR/big"
    du -sh "$DIR"/batch*
    echo "carry $DIR/batchN (one per call: the device tool carries 64 MiB) and run: $0 stash batchN"
    ;;
stash)
    mkdir -p "$STASH"
    cp -n "$DIR/${2:?stash needs the batch, e.g. batch0}"/* "$STASH"/
    ls -l "$STASH"
    ;;
install)
    cd "$STASH"
    cat "$NCCL_WHEEL".xz.part* | xz -d > "$NCCL_WHEEL"
    sha256sum -c "$NCCL_WHEEL.sha256"
    python3 -m pip install --no-deps --no-index --upgrade --target "$TARGET" ./*.whl
    PYTHONPATH="$TARGET:${PYTHONPATH:-}" python3 -c 'import nccl.core, nccl.ep; print("nccl4py", nccl.core.get_version())'
    ;;
env)
    echo "export PYTHONPATH=$TARGET\${PYTHONPATH:+:\$PYTHONPATH}"
    echo "export LD_PRELOAD=$TARGET/nvidia/nccl/lib/libnccl.so.2\${LD_PRELOAD:+:\$LD_PRELOAD}"
    ;;
*)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
