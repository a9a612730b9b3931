"""The shapes task: deterministic, well-posed, in TRL's VLM format; the dataset loader validates columns."""

import collections
import re

import numpy as np

from papo_nb.testbed.shapes import (
    COLOURS,
    GRID_COLS,
    KINDS,
    all_answers,
    make_shapes_dataset,
    task_corpus,
)


def pixel_bytes(dataset):
    return [example["image"].tobytes() for example in dataset]


def test_same_seed_gives_identical_pixels_and_text():
    a, b = make_shapes_dataset(12, seed=3), make_shapes_dataset(12, seed=3)
    assert pixel_bytes(a) == pixel_bytes(b)
    assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"] and a["kind"] == b["kind"]


def test_different_seed_gives_different_images():
    assert pixel_bytes(make_shapes_dataset(12, seed=0)) != pixel_bytes(make_shapes_dataset(12, seed=1))


def test_generation_does_not_touch_global_random_state():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    make_shapes_dataset(5, seed=9)
    assert random.random() == expected


def test_conversational_vlm_format(shapes_dataset):
    assert {"prompt", "image", "answer"} <= set(shapes_dataset.column_names)
    example = shapes_dataset[0]
    (message,) = example["prompt"]
    assert message["role"] == "user"
    image_part, text_part = message["content"]
    assert image_part["type"] == "image"
    assert text_part["type"] == "text" and text_part["text"].endswith("Answer with <answer>...</answer>.")
    assert example["image"].size == (112, 112) and example["image"].mode == "RGB"
    assert example["answer"] in all_answers()


def test_image_size_is_configurable():
    example = make_shapes_dataset(1, seed=0, image_size=224)[0]
    assert example["image"].size == (224, 224)


def test_kinds_are_balanced_and_answers_vary():
    dataset = make_shapes_dataset(300, seed=0)
    kinds = collections.Counter(dataset["kind"])
    assert kinds == dict.fromkeys(KINDS, 100)
    answers_by_kind = collections.defaultdict(set)
    for kind, answer in zip(dataset["kind"], dataset["answer"]):
        answers_by_kind[kind].add(answer)
    assert answers_by_kind["colour"] == set(COLOURS)
    assert answers_by_kind["count"] == {"1", "2", "3", "4"}
    assert answers_by_kind["side"] == {"left", "right"}


def test_text_alone_does_not_determine_the_answer():
    dataset = make_shapes_dataset(300, seed=0)
    answers_per_text = collections.defaultdict(set)
    for prompt, answer in zip(dataset["prompt"], dataset["answer"]):
        answers_per_text[prompt[0]["content"][1]["text"]].add(answer)
    assert all(len(answers) >= 2 for answers in answers_per_text.values())


def read_shapes_from_pixels(image) -> list[tuple[str, str, str]]:
    """An independent oracle: (shape, colour, side) of each shape, recovered from pixels alone.

    Each occupied 2x2-grid cell holds one solid shape; its bounding-box fill ratio tells the shape
    (square ~1.0, circle ~0.79, triangle ~0.5).
    """
    pixels = np.asarray(image)
    h, w, _ = pixels.shape
    found = []
    for row in range(2):
        for col in range(2):
            cell = pixels[row * h // 2 : (row + 1) * h // 2, col * w // 2 : (col + 1) * w // 2]
            mask = np.any(cell != 255, axis=-1)
            if not mask.any():
                continue
            ys, xs = np.nonzero(mask)
            fill = mask.sum() / ((ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1))
            shape = "square" if fill > 0.95 else "circle" if fill > 0.65 else "triangle"
            rgb = tuple(int(v) for v in cell[ys[len(ys) // 2], xs[len(xs) // 2]])
            colour = next(name for name, value in COLOURS.items() if value == rgb)
            found.append((shape, colour, "left" if col == 0 else "right"))
    return found


def test_answers_match_the_pixels_and_named_shape_is_unique():
    dataset = make_shapes_dataset(150, seed=5)
    for example in dataset:
        shapes = read_shapes_from_pixels(example["image"])
        text, kind, answer = example["prompt"][0]["content"][1]["text"], example["kind"], example["answer"]
        if kind == "count":
            assert len(shapes) == int(answer)
            continue
        named_shape = re.search(r"the (circle|square|triangle)\b", text).group(1)
        named = [s for s in shapes if s[0] == named_shape]
        assert len(named) == 1, (text, shapes)  # the question is well-posed
        shape, colour, side = named[0]
        assert answer == (colour if kind == "colour" else side), (text, shapes, answer)


def test_no_shape_crosses_the_vertical_midline():
    for example in make_shapes_dataset(60, seed=1):
        non_white = np.any(np.asarray(example["image"]) != 255, axis=-1)
        half = non_white.shape[1] // GRID_COLS
        assert not non_white[:, half - 1 : half + 1].any()


def test_task_corpus_covers_prompts_and_wrapped_answers(shapes_dataset):
    corpus = set(task_corpus())
    for prompt in shapes_dataset["prompt"]:
        assert prompt[0]["content"][1]["text"] in corpus
    for answer in all_answers():
        assert f"<answer>{answer}</answer>" in corpus
