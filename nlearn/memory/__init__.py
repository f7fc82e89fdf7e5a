"""Pure functional memory ops (no Flax, no configs)."""
