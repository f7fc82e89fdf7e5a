"""BABILong-style tasks (Kuratov et al. 2024, booydar/babilong): bAbI qa1-qa3 facts generated from templates,
scattered in order at random sentence boundaries of corpus text; and their training source
`data.source='babilong'`.

qa1 (single supporting fact): people move between rooms; "Where is Mary?" -> her last room. qa2 (two
supporting facts): people also pick up and drop objects; "Where is the apple?" -> the room of whoever carries
it, or where it was dropped. qa3 (three supporting facts): "Where was the apple before the kitchen?" -> the
room the object was in before it reached its current one. The prompt is BABILong's DEFAULT_TEMPLATE without
instruction, examples or post-prompt (their no-prompt setting, as used for fine-tuned models) followed by an
"Answer:" line, whose reply is the bare label (BABILong's target); scoring is BABILong's compare_answers.
"""

from __future__ import annotations

import ml_collections
import numpy as np

from nlearn.tasks import haystack
from nlearn.data.corpus import Corpus
from nlearn.errors import UserError

# booydar/babilong prompts.py DEFAULT_TEMPLATE, formatted with empty instruction, examples and post_prompt and
# stripped, as get_formatted_input does.
DEFAULT_TEMPLATE = "{instruction}\n{examples}\n{post_prompt}\n<context>\n{context}\n</context>\nQuestion: {question}"
ANSWER_PREFIX = "\nAnswer:"
# booydar/babilong metrics.py TASK_LABELS for qa1-qa3.
LOCATIONS = ("bathroom", "bedroom", "garden", "hallway", "kitchen", "office")
TASK_LABELS = {"qa1": set(LOCATIONS), "qa2": set(LOCATIONS), "qa3": set(LOCATIONS)}
# bAbI's people, objects and verbs.
PEOPLE = ("Mary", "John", "Daniel", "Sandra")
OBJECTS = ("apple", "football", "milk")
MOVES = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
GRABS = ("picked up", "got", "grabbed", "took")
DROPS = ("dropped", "discarded", "put down", "left")
FACTS = {"qa1": (2, 8), "qa2": (4, 12), "qa3": (6, 16)}  # facts per story: [low, high]


def format_input(context: str, question: str) -> str:
    """BABILong's get_formatted_input with the no-prompt configuration, then the answer line."""
    text = DEFAULT_TEMPLATE.format(instruction="", examples="", post_prompt="", context=context, question=question)
    return text.strip() + ANSWER_PREFIX


def preprocess_output(output: str) -> str:
    """BABILong's: lower-cased, first sentence, cut before any echoed context, example or question."""
    output = output.lower().split(".")[0]
    for marker in ("<context>", "<example>", "Question"):
        output = output.split(marker)[0]
    return output


def compare_answers(target: str, output: str, question: str, task_labels) -> bool:
    """BABILong's score: the target is the only task label in the reply's first sentence, labels that the
    question names excluded."""
    output = preprocess_output(output)
    labels = {label.lower() for label in task_labels}
    in_question = {label for label in labels if label in question.lower()}
    in_output = {label for label in labels if label in output} - in_question
    return target.lower() in in_output and len(in_output) == 1


def _pick(rng, options):
    return options[int(rng.integers(len(options)))]


def babi_story(rng: np.random.Generator, task: str) -> tuple[list[str], str, str]:
    """(facts, question, answer) of one qa1/qa2/qa3 story, simulated so the answer is determined."""
    if task not in FACTS:
        raise UserError(f"unknown babilong task {task!r}; choose from {', '.join(FACTS)}")
    low, high = FACTS[task]
    while True:
        n = int(rng.integers(low, high + 1))
        where, holder, obj_at, trail, facts = {}, {}, {}, {o: [] for o in OBJECTS}, []
        for _ in range(n):
            person = _pick(rng, PEOPLE)
            carrying = [o for o, h in holder.items() if h == person]
            roll = rng.random() if task != "qa1" else 0.0
            if roll < 0.6 or person not in where:
                room = _pick(rng, [r for r in LOCATIONS if r != where.get(person)])
                where[person] = room
                facts.append(f"{person} {_pick(rng, MOVES)} the {room}.")
                for o in carrying:
                    obj_at[o] = room
                    trail[o].append(room)
            elif carrying and roll < 0.8:
                o = _pick(rng, carrying)
                del holder[o]
                facts.append(f"{person} {_pick(rng, DROPS)} the {o}.")
            else:
                free = [o for o in OBJECTS if o not in holder and obj_at.get(o, where[person]) == where[person]]
                if not free:
                    continue
                o = _pick(rng, free)
                holder[o] = person
                obj_at[o] = where[person]
                if not trail[o] or trail[o][-1] != where[person]:
                    trail[o].append(where[person])
                facts.append(f"{person} {_pick(rng, GRABS)} the {o}{' there' if rng.random() < 0.5 else ''}.")
        if task == "qa1" and where:
            person = _pick(rng, sorted(where))
            return facts, f"Where is {person}?", where[person]
        if task == "qa2" and obj_at:
            o = _pick(rng, sorted(obj_at))
            return facts, f"Where is the {o}?", obj_at[o]
        moved = sorted(o for o, t in trail.items() if len(t) >= 2)
        if task == "qa3" and moved:
            o = _pick(rng, moved)
            return facts, f"Where was the {o} before the {trail[o][-1]}?", trail[o][-2]


def scatter(facts: list[str], sentences: list[str], rng: np.random.Generator) -> str:
    """`sentences` with the facts inserted in order at random sentence boundaries."""
    slots = sorted(int(s) for s in rng.integers(0, len(sentences) + 1, size=len(facts)))
    out, prev = [], 0
    for slot, fact in zip(slots, facts):
        out += sentences[prev:slot] + [fact]
        prev = slot
    return " ".join(out + sentences[prev:])


def babilong_example(rng: np.random.Generator, task: str, tokenizer, length: int, words) -> dict:
    """One prompt whose tokens with its reply and EOS number at most `length`: {"prompt", "prompt_ids",
    "question", "target", "answer_ids", "facts", "haystack_size"}."""
    facts, question, target = babi_story(rng, task)
    answer_ids = tokenizer.encode(" " + target)
    offset, seed = int(rng.integers(len(words))), int(rng.integers(2**63))

    def build(n):
        take = [words[(offset + i) % len(words)] for i in range(n)]
        sentences = haystack.split_sentences(" ".join(take))
        return format_input(scatter(facts, sentences, np.random.default_rng(seed)), question)

    n, ids = haystack.fit_to_budget(build, tokenizer, length - len(answer_ids) - 1, hint=256)
    return {"prompt": build(n), "prompt_ids": ids, "question": question, "target": target,
            "answer_ids": answer_ids, "facts": facts, "haystack_size": n}


def parse_tasks(spec: str, key: str = "data.babilong.tasks") -> list[str]:
    return haystack.parse_names(spec, FACTS, key)


SEED_TAG = 0x62616269  # "babi"


def qa_task(config: ml_collections.ConfigDict) -> haystack.QATask:
    """Stories of the tasks in data.babilong.tasks, scattered through corpus text."""
    return haystack.QATask("babilong", SEED_TAG, tuple(parse_tasks(config.data.babilong.tasks)), babilong_example,
                           True, f"babilong: {config.data.babilong.tasks} stories in text")


def babilong_source(config: ml_collections.ConfigDict) -> Corpus:
    """`data.source='babilong'`: windows of train.seq_len + 1 tokens, each a story of a task from
    data.babilong.tasks in corpus text of a random length in [data.babilong.min_len, seq_len], its answer and
    EOS; the loss falls on the answer and EOS only."""
    return haystack.qa_source(config, [qa_task(config)])
