"""A small local dataset in the official PAPO schema (``problem``, ``answer``, ``images``), drawn from the shapes task.

Same column names and types as ``PAPOGalaxy/PAPO_ViRL39K_train`` / ``PAPO_MMK12_test``: ``problem`` is a string with
one ``<image>`` placeholder per image, ``answer`` a string graded by mathruler, ``images`` a list of images. Some rows
carry two images, as the official data does, and image sizes vary so that the pixel bounds have work to do.
"""

from __future__ import annotations

import random

import datasets

from papo_nb.testbed.shapes import MAX_SHAPES, SHAPES, render_shapes

FEATURES = datasets.Features(
    {
        "problem": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "images": datasets.List(datasets.Image()),
    }
)
IMAGE_SIZES = (56, 84, 112, 140)  # pixels per side; 140x140 is above the tiny recipe's max_pixels


def _figure(rng: random.Random, size: int):
    n = rng.randint(1, MAX_SHAPES)
    placed = [(rng.choice(SHAPES), "blue", cell) for cell in rng.sample(range(MAX_SHAPES), n)]
    return render_shapes(placed, size, rng), n


def make_official_schema_dataset(n: int, seed: int = 0, two_image_every: int = 3) -> datasets.Dataset:
    """``n`` counting problems in the official schema; every ``two_image_every``-th row has two figures and asks
    for the total. Deterministic in ``seed``."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    rng = random.Random(seed)
    rows = {"problem": [], "answer": [], "images": []}
    for i in range(n):
        size = IMAGE_SIZES[i % len(IMAGE_SIZES)]
        if two_image_every and i % two_image_every == two_image_every - 1:
            (first, a), (second, b) = _figure(rng, size), _figure(rng, size)
            rows["problem"].append("<image><image>How many shapes are there in the two figures together?")
            rows["answer"].append(str(a + b))
            rows["images"].append([first, second])
        else:
            image, count = _figure(rng, size)
            rows["problem"].append("<image>How many shapes are in the figure?")
            rows["answer"].append(str(count))
            rows["images"].append([image])
    return datasets.Dataset.from_dict(rows, features=FEATURES)
