"""Thin absl entry points over importable functions (console scripts `nlearn-*`)."""
