"""A run's sentencepiece model as a Hugging Face tokenizer folder, for tools that size text with
`AutoTokenizer` (lm-eval's RULER tasks). Needs `transformers`, imported only here."""

from __future__ import annotations

import os
import shutil

from nlearn.errors import UserError


def write_hf_tokenizer(model_path: str, out_dir: str) -> str:
    """Write `out_dir` (tokenizer.model, tokenizer.json, tokenizer_config.json) so that
    `AutoTokenizer.from_pretrained(out_dir)` loads the same pieces and ids; returns `out_dir`.

    nlearn encodes line by line, so the Hugging Face tokenizer (which encodes a text whole) may split a
    line's first word differently: token counts agree closely, ids may differ at line starts.
    """
    try:
        from transformers import LlamaTokenizer
    except ImportError:
        raise UserError("writing a Hugging Face tokenizer needs transformers: pip install transformers") from None
    os.makedirs(out_dir, exist_ok=True)
    shutil.copyfile(model_path, os.path.join(out_dir, "tokenizer.model"))
    tokenizer = LlamaTokenizer.from_pretrained(out_dir, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                               pad_token="<pad>", add_bos_token=False, add_eos_token=False)
    tokenizer.save_pretrained(out_dir)
    return out_dir
