"""The paper's error category, measured on a language-prior testbed: each greedy answer to a prior-breaking item
(the number's colour is not the answer) is right, or *followed the prior* (the colour the question's number names),
*reported the decoy* (the other colour painted on the square, a misreading), or *other* (a colour neither named nor
shown, or no answer).

The split is clean only where the decoy is not the number's colour: there the prior's answer is a colour the image
does not show, so the text won over the image, while the decoy's is a colour it shows. ``shapes_shortcut`` draws its
held-out decoys apart from the number (``TestbedRecipe.held_out_prior_decoy``), so about two items in three are
clean; on the others, an answer with the named colour cannot be told from a misreading and is counted apart
(``PRIOR_IS_DECOY``). The paper reports 30.5% fewer perception errors for PAPO, classified by hand; here each class
is read from the item's pixels and its question.
"""

from __future__ import annotations

import math

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.perception import COLOURS, IMAGE_SIZE, prior_answer
from papo_nb.testbed.rewards import completion_text, extract_answer, normalise_answer
from papo_nb.workbook.evaluation.eval_review import prompt_text

# shares of the clean prior-breaking items (the decoy is not the number's colour); with the accuracy they sum to 1
PRIOR = "greedy/error_split/prior/vision"  # answered the number's colour, which the square does not show
DECOY = "greedy/error_split/decoy/vision"  # answered the decoy, a colour the square shows
OTHER = "greedy/error_split/other/vision"  # any other wrong answer
SHARE = "greedy/error_split/prior_share/vision"  # the prior's share of the clean items' errors (NaN without errors)
# the other prior-breaking items, whose decoy is the number's colour: the share answered with it (prior or misread)
PRIOR_IS_DECOY = "greedy/error_split/prior_is_decoy/vision"
CLEAN = "greedy/error_split/clean_items/vision"  # how many prior-breaking items are clean
SPLIT_METRICS = (PRIOR, DECOY, OTHER, SHARE, PRIOR_IS_DECOY)
# the split the pages written before this one recorded (docs/study/shortcut_lora), over every prior-breaking item:
# answered the number's colour against the image, another wrong answer, and the prior's share of the errors
LEGACY_SPLIT = (
    "greedy/errors/followed_prior/vision", "greedy/errors/misread/vision", "greedy/errors/prior_share/vision",
)  # fmt: skip


def decoy_colour(image, answer: str) -> str | None:
    """The task colour other than ``answer`` that most of the image's pixels show (None: the square has none)."""
    counts = dict.fromkeys(COLOURS, 0)
    names = {rgb: colour for colour, rgb in COLOURS.items()}
    for count, rgb in image.convert("RGB").getcolors(IMAGE_SIZE * IMAGE_SIZE):
        if names.get(rgb) not in (None, answer):
            counts[names[rgb]] += count
    best = max(counts, key=counts.get)
    return best if counts[best] else None


def error_split(
    answers: list[str | None], golds: list[str], priors: list[str], decoys: list[str | None]
) -> dict[str, float]:
    """The split of extracted ``answers`` (None: no answer) to prior-breaking items, by the colour each item's
    number names (``priors``) and its decoy (``decoys``); keys ``PRIOR``, ``DECOY``, ``OTHER``, ``SHARE``,
    ``PRIOR_IS_DECOY`` and ``CLEAN`` (a count). NaN where a class has no items."""
    items = list(zip(answers, golds, priors, decoys, strict=True))
    if any(g == p for _, g, p, _ in items):
        raise ValueError("error_split scores prior-breaking items only; some items' number names their answer")
    clean = [(a, g, p, d) for a, g, p, d in items if d != p]
    tied = [(a, p) for a, _, p, d in items if d == p]
    prior = sum(a == p for a, _, p, _ in clean)
    decoy = sum(a == d for a, _, _, d in clean)
    wrong = sum(a != g for a, g, _, _ in clean)

    def share(count: int, total: int) -> float:
        return count / total if total else math.nan

    return {
        PRIOR: share(prior, len(clean)),
        DECOY: share(decoy, len(clean)),
        OTHER: share(wrong - prior - decoy, len(clean)),
        SHARE: share(prior, wrong),
        PRIOR_IS_DECOY: share(sum(a == p for a, p in tied), len(tied)),
        CLEAN: float(len(clean)),
    }


def prior_errors(model, processor, data, *, max_new_tokens: int) -> dict[str, float]:
    """``error_split`` of the greedy answers with original images on the prior-breaking vision items of ``data``
    (prior-consistent items, the in-distribution split, are left out); empty without any."""
    rows = [
        i
        for i, (prompt, answer) in enumerate(zip(data["prompt"], data["answer"]))
        if prior_answer(prompt_text(prompt)) not in (None, normalise_answer(str(answer)))
    ]
    if not rows:
        return {}
    items = data.select(rows)
    golds = [normalise_answer(str(a)) for a in items["answer"]]
    was_training = model.training
    model.eval()
    try:
        completions = generate_answers(
            model, processor, list(items["prompt"]), list(items["image"]), max_new_tokens=max_new_tokens, batch_size=64
        )
    finally:
        model.train(was_training)
    return error_split(
        [extract_answer(completion_text(c)) for c in completions],
        golds,
        [prior_answer(prompt_text(p)) for p in items["prompt"]],
        [decoy_colour(image, gold) for image, gold in zip(items["image"], golds)],
    )
