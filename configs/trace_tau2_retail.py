"""TRACE on τ²-bench retail with the paper's settings, for a real model on an accelerator.

  python -m launch.trace --config=configs/trace_tau2_retail.py --workdir=runs/trace_tau2_retail \
      --config.model=/path/to/hf_checkpoint [--config.analysis.analyst=llm --config.llm.model=...]

The base agent plays τ²'s retail train split for the analysis and its test split held out,
greedy, up to 30 agent turns, with the base model as the user simulator (τ²'s own evaluator
scores). Capabilities come from the programmatic analyst (or the LLM one: any OpenAI-compatible
endpoint, `config.llm`); each selected one's built-in environment is calibrated on 20 seeds x 8
samples at temperature 1 (the paper's gates) and trained with the released code's GRPO settings:
groups of 16, 4 groups per step, LoRA rank 16 / alpha 16 on q, k, v, o, lr 1e-5, clip 0.2 / 0.28,
no KL, 40 iterations per capability, bf16.
"""

import ml_collections

from configs import tau2_retail, trace_embedded


def get_config() -> ml_collections.ConfigDict:
    config = trace_embedded.get_config()
    evaluation = tau2_retail.get_config()
    config.model = ""  # required: an HF checkpoint folder (Llama / Qwen2 / Qwen3)
    config.dtype = "bfloat16"
    config.log_every_s = 60.0
    config.target = ml_collections.ConfigDict(
        dict(
            env=evaluation.env.to_dict(),
            analysis_split="train",
            analysis_tasks=74,
            heldout_split="test",
            heldout_tasks=40,
            base_run="",
            rollout=dict(
                batch_size=64,
                max_turns=30,
                max_tokens_per_turn=1024,
                max_errors=10,
                temperature=0.0,
                top_p=1.0,
                user_temperature=0.0,
            ),
        )
    )
    config.environments.max_trained = 4  # the paper trained four
    config.calibration.update(seeds=20, samples=8)
    config.training.lora.update(rank=16, alpha=16.0, targets=("q_proj", "k_proj", "v_proj", "o_proj"), first_layer=0)
    config.training.rollout.update(
        tasks_per_step=4, group_size=16, batch_size=64, max_turns=30, max_tokens_per_turn=1024, max_errors=10
    )
    config.training.optimizer.lr = 1e-5
    config.training.train.update(steps=40, micro_batch_tokens=16384, remat=True, updates_per_step=1)
    # the released code's loss, not the embedded config's compressed CPU schedule (its KL term, token_mean, the
    # hinted rows' own clip)
    config.training.loss.update(aggregation="seq_mean_token_mean", kl_coef=0.0, hinted_eps_high=None)
    config.training.eval.update(num_tasks=32, batch_size=32, every=40, keep_best=False)  # the last step's adapter
    config.routing.calibration = "none"  # the paper's router: the raw label logits of the frozen base model
    config.environments.source = "auto"  # built-in generators, and the LLM writes the others (config.llm)
    return config
