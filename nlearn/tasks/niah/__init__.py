"""RULER needle-in-a-haystack: prompts in corpus text (`data`) and recall by length and depth (`score`)."""
