"""Synthetic tasks, each with its generator and training source (`<task>/data.py`, `data.source=<task>`)
beside its scorer (`<task>/score.py`, `nlearn-eval --task=<task>`): `mqar`, `niah` (RULER S-NIAH),
`babilong` (bAbI facts in corpus text).

Shared here: `haystack` (the text the long-context tasks hide facts in, fitting a prompt to a length),
`longctx` (scoring by length and depth) and `curriculum` (training on shorter windows first). The data
and eval registries name these modules as strings, so `nlearn.data` never imports a task.
"""
