"""GRPO: group advantages, clipped policy losses, and the jitted learner step."""
