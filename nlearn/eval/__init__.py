"""Evaluation: perplexity on held-out text, synthetic recall, generation with recurrent state."""
