"""The learner: GRPO on a LoRA adapter, from the judged traffic the proxy recorded."""

from learner.loss import group_advantages, grpo_loss

__all__ = ["group_advantages", "grpo_loss"]
