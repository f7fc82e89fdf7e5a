"""RULER S-NIAH: templates byte for byte, needles at the asked depths, lengths within budget, the scorer."""

import re

import numpy as np
import pytest

from nlearn.tasks.niah import data as niah
from nlearn.errors import UserError

WORDS = tuple("It is a truth universally acknowledged. That a single man must be in want of a wife! "
              "However little known the feelings or views of such a man may be? This truth is well fixed.".split())


def test_templates_are_rulers():
    assert niah.NEEDLE == "One of the special magic {type_needle_v} for {key} is: {value}."
    assert niah.REPEAT_FILLER == ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
                                  "There and back again.")
    single, noun = niah.prompt_template(niah.VARIANTS["single_1"])
    assert noun == "number" and single == (
        "A special magic {type_needle_v} is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat is the special magic "
        "{type_needle_v} for {query} mentioned in the provided text? The special magic {type_needle_v} for "
        "{query} mentioned in the provided text is")
    many, noun = niah.prompt_template(niah.VARIANTS["multivalue"])
    assert noun == "numbers" and many == (
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text? The special magic {type_needle_v} for "
        "{query} mentioned in the provided text are")


def test_single_1_prompt_byte_for_byte(tokenizer):
    ex = niah.niah_example(np.random.default_rng(3), niah.VARIANTS["single_1"], tokenizer, 10_000, 0.5)
    key, (value,) = ex["prompt"].split("for ")[1].split(" is: ")[0], ex["answers"]
    assert len(value) == 7 and value.isdigit() and value[0] != "0"
    n = ex["haystack_size"]
    filler = [niah.REPEAT_FILLER] * n
    filler.insert(min(n // 2, n - 1), f"One of the special magic numbers for {key} is: {value}.")
    expected = ("A special magic number is hidden within the following text. Make sure to memorize it. I will quiz "
                "you about the number afterwards.\n" + "\n".join(filler) + "\nWhat is the special magic number for "
                f"{key} mentioned in the provided text? The special magic number for {key} mentioned in the "
                "provided text is")
    assert ex["prompt"] == expected
    assert key.split("-")[0] in niah.ADJECTIVES and key.split("-")[1] in niah.NOUNS


@pytest.mark.parametrize("name", list(niah.VARIANTS))
def test_every_variant_fits_its_length_and_hides_its_answers(name, tokenizer):
    v = niah.VARIANTS[name]
    ex = niah.niah_example(np.random.default_rng(0), v, tokenizer, 2048, 0.25, WORDS)
    used = len(ex["prompt_ids"]) + len(ex["answer_ids"]) + 1
    assert 2048 - 120 < used <= 2048  # filled to within a haystack unit or two
    assert len(ex["answers"]) == v.num_needle_v * v.num_needle_q
    for a in ex["answers"]:
        assert f"is: {a}." in ex["prompt"]
    if v.type_needle_v == "uuids":
        assert all(len(a) == 36 and a[14] == "4" for a in ex["answers"])
    template, noun = niah.prompt_template(v)
    assert len(ex["queries"]) == v.num_needle_q
    assert ex["prompt"].endswith(template.split("{context}")[1].format(
        type_needle_v=noun, query=niah.query_text(ex["queries"])))


def test_multiquery_joins_keys_as_ruler():
    assert niah.query_text(["a-b"]) == "a-b"
    assert niah.query_text(["a-b", "c-d", "e-f", "g-h"]) == "a-b, c-d, e-f, and g-h"


@pytest.mark.parametrize("evaluation", [False, True])
@pytest.mark.parametrize("depth", [0.0, 0.5, 0.999, 1.0])
def test_needle_sits_at_its_depth_never_after_the_last_unit(depth, evaluation, tokenizer):
    ex = niah.niah_example(np.random.default_rng(1), niah.VARIANTS["single_1"], tokenizer, 4096, depth,
                           evaluation=evaluation)
    lines = ex["prompt"].split("\n")[1:-1]
    at = next(i for i, line in enumerate(lines) if line.startswith("One of the special magic"))
    units = len(lines) - 1
    assert at == min(int(depth * units), units - 1)
    assert lines[-1] == niah.REPEAT_FILLER  # RULER's placement: haystack always follows the needle


@pytest.mark.parametrize("units", [1, 2, 7, 40])
def test_no_needle_is_placed_after_the_last_haystack_unit(units):
    for depth in np.linspace(0.0, 1.0, 41):
        for count in (1, 2, 4):
            out = niah.insert_at_depths(["unit"] * units, [f"needle{i}" for i in range(count)],
                                        niah.needle_depths(float(depth), count))
            assert out[-1] == "unit" and len(out) == units + count


@pytest.mark.parametrize("length", [512, 2048])
def test_evaluation_prompts_reserve_rulers_128_reply_tokens(length, tokenizer):
    for seed in range(3):
        ex = niah.niah_example(np.random.default_rng(seed), niah.VARIANTS["single_1"], tokenizer, length, 0.5,
                               evaluation=True)
        assert length - niah.REPLY_TOKENS - 120 < len(ex["prompt_ids"]) <= length - niah.REPLY_TOKENS  # a unit or two
    with pytest.raises(UserError, match="128 reply tokens"):
        niah.niah_example(np.random.default_rng(0), niah.VARIANTS["single_1"], tokenizer, 100, 0.5, evaluation=True)


def test_no_evaluation_key_occurs_among_the_training_keys(tokenizer):
    adjectives, nouns = niah.heldout_words()
    assert len(adjectives) > 500 and len(nouns) > 5000  # wonderwords' lists, as RULER's
    assert not set(adjectives) & set(niah.ADJECTIVES) and not set(nouns) & set(niah.NOUNS)
    training = {f"{a}-{n}" for a in niah.ADJECTIVES for n in niah.NOUNS}
    rng = np.random.default_rng(0)
    drawn = [niah.random_value(rng, "words", heldout=True) for _ in range(5000)]
    assert not set(drawn) & training and len(set(drawn)) > 4900
    for seed in range(5):  # the evaluation's own prompts, multi-key included
        ex = niah.niah_example(np.random.default_rng(seed), niah.VARIANTS["multikey_2"], tokenizer, 1024, 0.5,
                               evaluation=True)
        keys = set(re.findall(r"for ([a-z]+-[a-z]+) is:", ex["prompt"]))
        assert keys and not keys & training
        train_ex = niah.niah_example(np.random.default_rng(seed), niah.VARIANTS["single_1"], tokenizer, 1024, 0.5)
        assert set(train_ex["queries"]) <= training


def test_string_match_all_and_its_near_misses():
    score = niah.string_match_all
    assert score("1234567.", ["1234567"]) == 1.0
    assert score(" The number is 1234567, I think", ["1234567"]) == 1.0  # RULER: substring
    assert score("123456.", ["1234567"]) == 0.0  # one digit short
    assert score("1234576.", ["1234567"]) == 0.0  # two digits swapped
    assert score("7654321", ["1234567"]) == 0.0
    assert score("", ["1234567"]) == 0.0
    assert score("1111111, 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert score("ABCDEF01-AAAA-4BBB-8CCC-000000000000", ["abcdef01-aaaa-4bbb-8ccc-000000000000"]) == 1.0


def test_char_matches_find_the_lost_digits():
    assert niah.char_matches(" 1234567.", "1234567") == [True] * 7
    assert niah.char_matches("9234567", "1234567") == [False] + [True] * 6  # the first digit
    assert niah.char_matches("12345", "1234567") == [True] * 5 + [False] * 2  # cut short
    assert niah.char_matches("", "12") == [False, False]
    assert niah.char_matches("ABC", "abc") == [True] * 3


def test_char_accuracy_by_length_skips_multi_answer_prompts():
    from nlearn.tasks.niah.score import char_accuracy
    records = [{"length": 512, "targets": ["1234567"], "output": "1234567."},
               {"length": 512, "targets": ["1234567"], "output": "9234560"},
               {"length": 512, "targets": ["1111111", "2222222"], "output": "0000000"},
               {"length": 2048, "targets": ["12"], "output": "10"},
               {"length": 2048, "targets": ["123"], "output": "123"}]  # mixed answer lengths: left out
    assert char_accuracy(records) == {"512": [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5]}


def test_bad_variant_names_the_choices():
    with pytest.raises(UserError, match="single_1"):
        niah.parse_variants("single_9", key="--variant")
    assert niah.parse_variants("all") == list(niah.VARIANTS)


def test_prompts_answered_from_non_finite_logits_are_counted_and_named(capsys):
    from nlearn.tasks import longctx

    records = [{"length": 512, "finite": True}, {"length": 2048, "finite": False}, {"length": 2048, "finite": True}]
    result = {}
    longctx.flag_non_finite(result, records, "niah")
    assert result["non_finite"] == {"2048": 1}
    assert "not finite for 1 of 2 prompts at 2048 tokens" in capsys.readouterr().err
    clean = {}
    longctx.flag_non_finite(clean, records[:1], "niah")
    assert "non_finite" not in clean


def test_each_swept_length_reports_one_progress_line(capsys):
    from nlearn.tasks import longctx

    longctx.report_length("niah", "single_1", 8192, [1.0, 0.0, 1.0, 1.0], started=0.0)
    line = capsys.readouterr().err
    assert line.startswith("niah single_1 at 8192 tokens: 4 prompts, accuracy 75% (") and line.count("\n") == 1


def test_tables_give_each_length_its_prompt_count_and_95_percent_interval():
    from nlearn.tasks import longctx

    assert longctx.wilson_interval(1.0, 100) == pytest.approx((0.963, 1.0), abs=1e-3)
    assert longctx.wilson_interval(0.5, 100) == pytest.approx((0.404, 0.596), abs=1e-3)
    scores = [("single_1", 512, 0.0, 1.0)] * 90 + [("single_1", 512, 0.5, 0.0)] * 10 + [("single_1", 2048, 0.0, 0.0)]
    table = longctx.table(scores)
    assert table["prompts_by_length"] == {"512": 100, "2048": 1}
    low, high = table["ci95_by_length"]["512"]
    assert low < 0.9 < high and high - low < 0.13
