"""Policies: a bundle's policy.json and its LoRA adapter, read without torch."""
