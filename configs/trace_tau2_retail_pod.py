"""TRACE on τ²-bench retail as several processes of one JAX run: a Cloud TPU pod slice (launch/tpu_pod.sh) or
GPU hosts under Slurm (launch/slurm_gpu.sbatch), with configs/trace_tau2_retail.py's (the paper's) settings.

  launch/tpu_pod.sh run .venv/bin/python -m launch.trace --config=configs/trace_tau2_retail_pod.py \
      --workdir=/mnt/shared/trace --config.model=/mnt/shared/Qwen3-8B [--config.training.mesh.tensor=4]

Every process plays its share of each evaluation, calibration and GRPO step on its own devices; the learner
runs on the mesh of every process's devices. Built-in capability environments (a run of several processes
does not have the LLM write environments). bf16 throughout. `training.mesh.tensor` shards the weights over
that many devices of each process (4 on a v5e / v6e host, up to 8 on a GPU host run as one process) for every
sampler (evaluations, calibration, training rollouts) and the learner, where one device cannot hold the model
with its KV cache and activations (an 8B model in bf16 is 16 GB; a v5e chip holds 16 GB). The router's
forward pass holds the model on one device.
"""

import ml_collections

from configs import trace_tau2_retail


def get_config() -> ml_collections.ConfigDict:
    config = trace_tau2_retail.get_config()
    config.environments.source = "builtin"
    config.training.mesh.update(data=-1, fsdp=1, tensor=1)
    return config
