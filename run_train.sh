#!/usr/bin/env bash
# Launch titan on this node with torchrun.
#   NGPU         ranks on this node (default: number of visible GPUs, else 1)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml)
#   LOG_RANK     comma-separated ranks whose output is shown (default: 0)
#   MAX_RESTARTS restart the whole job this many times when a rank fails; each restart
#                resumes from the newest complete checkpoint (default: 0, interactive use)
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

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NGPU > 0 ? $(nproc) / NGPU : 1 ))}

exec "$PYTHON" -m titan.launch \
    --standalone --nnodes=1 --nproc_per_node="$NGPU" \
    --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    --max-restarts="${MAX_RESTARTS:-0}" \
    -- --job.config_file "$CONFIG_FILE" "$@"
