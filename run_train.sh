#!/usr/bin/env bash
# Launch titan with torchrun: on this node, or as one node of a multi-node job.
#   NGPU          ranks on this node (default: number of visible GPUs, else 1)
#   CONFIG_FILE   TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK      comma-separated local ranks whose output is shown on each node (default: 0)
#   MAX_RESTARTS  restart the job this many times when a rank (or, elastic, a node) fails; each
#                 restart resumes from the newest complete checkpoint (default: 0, interactive)
# Multi-node (torchrun's c10d rendezvous; run this script once per node):
#   NNODES        node count, or MIN:MAX for an elastic job that goes on with fewer nodes
#                 when one dies (default: 1, a single standalone node)
#   RDZV_ENDPOINT host:port every node can reach, usually the first node (needed if NNODES > 1)
#   NODE_RANK     this node's rank (optional: the rendezvous assigns one otherwise)
#   RDZV_ID       job id shared by the nodes (default: derived from job.dump_folder)
#   RDZV_CONF     extra rendezvous settings, e.g. is_host=true,last_call_timeout=10
#   DRY_RUN=1     validate, print the torchrun command this node would run, and exit
# Every argument is a config override, e.g. --training.steps 20 (see --help).
set -euo pipefail
# relative paths stay relative to where the user is; titan itself is found from here
HERE="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

if [[ -z "${NGPU:-}" ]]; then
    NGPU=$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)
    [[ "$NGPU" -ge 1 ]] || NGPU=1
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
LOG_RANK=${LOG_RANK:-0}
PYTHON=${PYTHON:-python}
NNODES=${NNODES:-1}

if [[ "$NNODES" == "1" ]]; then
    NODES=(--standalone --nnodes=1)
else
    if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
        echo "titan: config error: NNODES=$NNODES needs RDZV_ENDPOINT=host:port, an address" \
             "of the first node that every node can reach" >&2
        exit 2
    fi
    NODES=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT")
    [[ -z "${NODE_RANK:-}" ]] || NODES+=(--node-rank="$NODE_RANK")
    [[ -z "${RDZV_ID:-}" ]] || NODES+=(--rdzv-id="$RDZV_ID")
    [[ -z "${RDZV_CONF:-}" ]] || NODES+=(--rdzv-conf="$RDZV_CONF")
fi

# the cores shared among this node's ranks; an NGPU that is no rank count (0, abc) is left to
# the launcher, which says so in one line (bash arithmetic would fail on it first)
if [[ "$NGPU" =~ ^[0-9]+$ ]] && (( 10#$NGPU >= 1 )); then
    per_rank=$(( $(nproc) / 10#$NGPU ))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( per_rank > 0 ? per_rank : 1 ))}
fi

exec "$PYTHON" -m titan.launcher \
    "${NODES[@]}" --nproc_per_node="$NGPU" \
    --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    --max-restarts="${MAX_RESTARTS:-0}" \
    -- --job.config_file "$CONFIG_FILE" "$@"
