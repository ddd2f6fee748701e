"""The judge: samples groups of answers to real prompts and scores them (RULER or verifiers)."""
