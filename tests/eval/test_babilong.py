"""BABILong qa1-qa3: stories whose answers an independent reading of the facts confirms, the prompt format,
facts kept in order inside the haystack, and BABILong's scorer with its near misses."""

import re

import numpy as np
import pytest

from nlearn.tasks.babilong import data as babilong

WORDS = tuple(("It is a truth universally acknowledged. That a single man must be in want of a wife! However "
               "little known the feelings or views of such a man may be? This truth is well fixed. ") .split() * 40)


def read_story(facts):
    """Replays the facts as text: where each person and object is, and each object's trail of rooms."""
    where, holder, at, trail = {}, {}, {}, {}
    for fact in facts:
        move = re.fullmatch(r"(\w+) (?:moved to|went to|journeyed to|travelled to|went back to) the (\w+)\.", fact)
        grab = re.fullmatch(r"(\w+) (?:picked up|got|grabbed|took) the (\w+)(?: there)?\.", fact)
        drop = re.fullmatch(r"(\w+) (?:dropped|discarded|put down|left) the (\w+)\.", fact)
        if move:
            person, room = move.groups()
            where[person] = room
            for obj, h in holder.items():
                if h == person:
                    at[obj] = room
                    trail.setdefault(obj, []).append(room)
        elif grab:
            person, obj = grab.groups()
            assert obj not in holder and at.get(obj, where[person]) == where[person], fact
            holder[obj], at[obj] = person, where[person]
            if trail.get(obj, [None])[-1] != where[person]:
                trail.setdefault(obj, []).append(where[person])
        else:
            person, obj = drop.groups()
            assert holder.pop(obj) == person, fact
    return where, at, trail


@pytest.mark.parametrize("task", ["qa1", "qa2", "qa3"])
def test_story_answers_follow_from_the_facts(task):
    for seed in range(200):
        facts, question, answer = babilong.babi_story(np.random.default_rng(seed), task)
        where, at, trail = read_story(facts)
        if task == "qa1":
            person = re.fullmatch(r"Where is (\w+)\?", question).group(1)
            assert answer == where[person]
        elif task == "qa2":
            obj = re.fullmatch(r"Where is the (\w+)\?", question).group(1)
            assert answer == at[obj]
        else:
            obj, last = re.fullmatch(r"Where was the (\w+) before the (\w+)\?", question).groups()
            assert trail[obj][-1] == last and answer == trail[obj][-2]


def test_prompt_format_and_facts_in_order(tokenizer):
    ex = babilong.babilong_example(np.random.default_rng(5), "qa2", tokenizer, 1024, WORDS)
    assert ex["prompt"].startswith("<context>\n") and ex["prompt"].endswith(
        f"\n</context>\nQuestion: {ex['question']}\nAnswer:")
    positions = [ex["prompt"].index(f) for f in ex["facts"]]
    assert positions == sorted(positions) and ex["haystack_size"] > 50
    assert len(ex["prompt_ids"]) + len(ex["answer_ids"]) + 1 <= 1024
    assert tokenizer.decode(ex["answer_ids"]).strip() == ex["target"]
    assert babilong.format_input("C", "Q?") == "<context>\nC\n</context>\nQuestion: Q?\nAnswer:"


def test_compare_answers_as_babilong():
    labels = babilong.TASK_LABELS["qa1"]
    ok = babilong.compare_answers
    assert ok("kitchen", "kitchen", "Where is Mary?", labels)
    assert ok("kitchen", " Kitchen. Then the garden.", "Where is Mary?", labels)  # first sentence only
    assert not ok("kitchen", "kitchen or garden", "Where is Mary?", labels)  # two labels
    assert not ok("kitchen", "garden. kitchen", "Where is Mary?", labels)  # the right label too late
    assert not ok("kitchen", "the kitch", "Where is Mary?", labels)
    assert not ok("kitchen", "", "Where is Mary?", labels)
    # a label the question names is never an answer: it is dropped from the reply
    assert ok("bathroom", "kitchen, then bathroom", "Where was the apple before the kitchen?", labels)
    assert not ok("kitchen", "kitchen", "Where was the apple before the kitchen?", labels)
