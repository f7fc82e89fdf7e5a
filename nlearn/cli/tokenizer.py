"""nlearn-tokenizer: train (or find the cached) sentencepiece model.

  nlearn-tokenizer --config=configs/transformer.py:tiny          # the config's corpus, cached
  nlearn-tokenizer --input='~/corpus/*.txt' --vocab_size=8192 --output=my_spm
  nlearn-tokenizer --workdir=runs/niah-lmm --hf_dir=runs/niah-lmm/hf_tokenizer   # for lm-eval's RULER tasks

With --hf_dir, the model is also written as a Hugging Face tokenizer folder (needs `transformers`).
"""

import glob
import os
import pathlib

from absl import flags
from ml_collections import config_flags

from nlearn.cli.common import run as run_app
from nlearn.errors import UserError

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config whose corpus and data.vocab_size to use.", lock_config=True)
_INPUT = flags.DEFINE_string("input", None, "Glob of UTF-8 text files to train on (instead of --config).")
_VOCAB = flags.DEFINE_integer("vocab_size", 8192, "Vocabulary size with --input.")
_OUTPUT = flags.DEFINE_string("output", "tokenizer", "Model prefix with --input (writes PREFIX.model).")
_WORKDIR = flags.DEFINE_string("workdir", None, "A run directory: its tokenizer (instead of --config/--input).")
_HF_DIR = flags.DEFINE_string("hf_dir", None, "Also write the model as a Hugging Face tokenizer folder here.")


def main(argv):
    from nlearn import data
    from nlearn.data.tokenizer import train_tokenizer

    if _INPUT.value:
        files = sorted(glob.glob(os.path.expanduser(_INPUT.value)))
        if not files:
            raise UserError(f"--input={_INPUT.value!r} matches no files")
        path = train_tokenizer([pathlib.Path(f).resolve() for f in files], _OUTPUT.value, _VOCAB.value)
    elif _CONFIG.value is not None:
        path = data.get_tokenizer(_CONFIG.value).path
    elif _WORKDIR.value:
        from nlearn.tasks.haystack import text_tokenizer
        from nlearn.eval.restore import load_run_config

        tokenizer = text_tokenizer(load_run_config(_WORKDIR.value))
        if tokenizer is None:
            raise UserError(f"run {_WORKDIR.value!r} was trained on token ids: it has no tokenizer")
        path = tokenizer.path
    else:
        raise UserError("pass --config=<file>:<preset>, --workdir=<run> or --input=<glob>")
    print(path, flush=True)
    if _HF_DIR.value:
        from nlearn.data.hf_tokenizer import write_hf_tokenizer

        print(write_hf_tokenizer(path, _HF_DIR.value), flush=True)


def run():
    run_app(main)


if __name__ == "__main__":
    run()
