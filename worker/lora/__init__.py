"""LoRA adapters: validation and loading (adapter), GPU slot stacks (slots), tiers (registry)."""
