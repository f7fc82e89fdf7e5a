"""benchmarks/stability.py: its rows and the table it writes (the sweep itself takes hours)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import stability  # noqa: E402


def test_rows_are_every_family_titans_first():
    rows = stability.default_rows()
    families = [r.split(":")[0] for r in rows]
    assert families[:4] == list(stability.TITANS) and len(set(families)) == len(families) >= 12
    assert "titans_mac:model.num_layers=3:model.mlp_dim=320" in rows  # the ladder's parameter-matched row


def test_table_marks_nan_rows():
    runs = [{"row": "titans_lmm", "seed": 1, "error": "error: training loss became nan at step 30", "nan": True},
            {"row": "deltanet", "seed": 0, "nan": False, "final_loss": 6.1234, "perplexity": 701.94,
             "fast_weight_norm": 12.34}]
    text = stability.table(runs)
    assert "| titans_lmm | 1 | | | | **nan**: `error: training loss became nan at step 30` |" in text
    assert "| deltanet | 0 | 6.123 | 701.9 | 12.3 | no |" in text
