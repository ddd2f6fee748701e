"""The learner: GRPO on a LoRA adapter, from the judged traffic the proxy recorded."""

from learner.loss import GRPOLossConfig, group_advantages, grpo_loss

__all__ = ["GRPOLossConfig", "group_advantages", "grpo_loss"]
