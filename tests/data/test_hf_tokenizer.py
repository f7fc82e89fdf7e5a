"""A run's sentencepiece model written as a Hugging Face tokenizer folder (for lm-eval's RULER tasks, which
size their prompts with `AutoTokenizer`); runs only where `transformers` is installed."""

import pytest

pytest.importorskip("transformers")


def test_hf_folder_loads_with_the_same_pieces_and_counts(tmp_path):
    from transformers import AutoTokenizer

    from nlearn.data.hf_tokenizer import write_hf_tokenizer
    from nlearn.data.tokenizer import load_tokenizer, train_tokenizer

    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
    ours = load_tokenizer(train_tokenizer([text * 20 + "One of the special magic numbers is: 1234567.\n"],
                                          str(tmp_path / "spm"), 300))
    hf = AutoTokenizer.from_pretrained(write_hf_tokenizer(ours.path, str(tmp_path / "hf")))
    assert (hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (ours.eos_id, ours.pad_id, ours.unk_id)
    line = "One of the special magic numbers for the grass is: 7654321. The sky is blue."
    assert hf(line, add_special_tokens=False).input_ids == ours.encode(line).tolist()  # one line: the same ids
    lines = "\n".join([line] * 8)
    n_hf, n_ours = len(hf(lines, add_special_tokens=False).input_ids), len(ours.encode(lines))
    assert abs(n_hf - n_ours) <= 8, (n_hf, n_ours)  # several lines: at most a piece apart at each line start
