"""nlearn without lm-eval: the adapter, when asked for, says in one line what to install."""

import importlib
import sys

import pytest

from nlearn.errors import UserError


def test_adapter_without_lm_eval_says_what_to_install(monkeypatch):
    for name in [n for n in sys.modules if n == "nlearn.eval.harness" or n.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` now fails as if not installed
    with pytest.raises(UserError, match=r"^the lm-eval adapter needs .*pip install 'nlearn\[eval\]'") as e:
        importlib.import_module("nlearn.eval.harness")
    assert "\n" not in str(e.value)
    importlib.import_module("nlearn.eval.scoring")  # the scoring it wraps needs no lm-eval
