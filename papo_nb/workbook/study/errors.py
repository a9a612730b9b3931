"""The paper's error category, measured on a language-prior testbed: each held-out error on a prior-breaking item is
either *followed the prior* (the answer is the colour the question's number names while most of the square shows
another colour: the text won over the image) or *misread the image* (any other wrong answer, the square's majority
colour included where a decoy covers most of it, as on ``shapes_shortcut``).

The paper reports 30.5% fewer perception errors for PAPO (classified by hand); here the split is exact, because on a
prior-breaking item the prior's answer is never right and the image's majority colour is known from its pixels.
"""

from __future__ import annotations

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.perception import majority_colour, prior_answer
from papo_nb.testbed.rewards import completion_text, extract_answer, normalise_answer
from papo_nb.workbook.evaluation.eval_review import prompt_text

FOLLOWED = "greedy/errors/followed_prior/vision"  # share of the items answered with the prior's colour
MISREAD = "greedy/errors/misread/vision"  # share of the items answered with another wrong colour (or none)
SHARE = "greedy/errors/prior_share/vision"  # the prior's share of the errors


def prior_error_split(
    answers: list[str | None], golds: list[str], priors: list[str], majorities: list[str | None]
) -> dict[str, float]:
    """Shares of items answered with the prior's colour against the image's majority colour and with another wrong
    answer, and the prior's share of the errors (NaN without errors); ``answers`` are extracted answers (None: no
    answer in the completion)."""
    followed = sum(a == p != m for a, p, m in zip(answers, priors, majorities, strict=True))
    wrong = sum(a != g for a, g in zip(answers, golds))
    return {
        FOLLOWED: followed / len(golds),
        MISREAD: (wrong - followed) / len(golds),
        SHARE: followed / wrong if wrong else float("nan"),
    }


def prior_errors(model, processor, data, *, max_new_tokens: int) -> dict[str, float]:
    """``prior_error_split`` of the greedy answers with original images on the prior-breaking vision items of
    ``data``; empty when ``data`` has no prior questions (a testbed without a language prior)."""
    rows = [i for i, prompt in enumerate(data["prompt"]) if prior_answer(prompt_text(prompt)) is not None]
    if not rows:
        return {}
    items = data.select(rows)
    golds = [normalise_answer(str(a)) for a in items["answer"]]
    priors = [prior_answer(prompt_text(p)) for p in items["prompt"]]
    if any(g == p for g, p in zip(golds, priors)):
        raise ValueError("prior_errors scores prior-breaking items only; some held-out items follow the prior")
    was_training = model.training
    model.eval()
    try:
        completions = generate_answers(
            model, processor, list(items["prompt"]), list(items["image"]), max_new_tokens=max_new_tokens, batch_size=64
        )
    finally:
        model.train(was_training)
    answers = [extract_answer(completion_text(c)) for c in completions]
    return prior_error_split(answers, golds, priors, [majority_colour(image) for image in items["image"]])
