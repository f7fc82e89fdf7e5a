"""nlearn: language models whose token mixers keep learning while they read."""

__version__ = "0.1.0"
