"""The perception testbed's policy: build (warm start, validation stop, held-out card), cache and read back.

The task and the supervised warm start live in ``papo_nb.testbed.perception``; building the policy scores it with the
workbook's greedy generation and the official raw-image mask, so it lives here. Workbook parameters name the result
``testbed:shapes`` (``workbook.config.paths.resolve_model_path``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from papo_nb.testbed.generation import generate_answers
from papo_nb.testbed.models import FAMILIES, build_cached, build_tiny_processor, default_cache_root, tiny_config
from papo_nb.testbed.perception import (
    CARD_FILE,
    CARD_ITEMS,
    CARD_SEED,
    CHANCE_VISION,
    SFT_BATCH,
    SFT_LR,
    SFT_MAX_STEPS,
    TESTBED_RECIPES,
    TESTBED_VERSION,
    TESTBEDS,
    VALIDATION_ITEMS,
    VALIDATION_SEED,
    make_perception_dataset,
    warm_start,
)
from papo_nb.testbed.raw_masks import mask_pil_squares
from papo_nb.testbed.rewards import accuracy_reward


def score_card(
    model, processor, name: str = "shapes", n_items: int = CARD_ITEMS, seed: int = CARD_SEED, ratios=(0.0, 0.6, 1.0)
) -> dict[str, float]:
    """Held-out greedy accuracy per split (``<condition>/vision|text|all``) with original images (ratio 0) and
    images masked with the official 14x14 squares at each other ratio (``masked_<ratio>``).

    A testbed with a language prior scores its held-out distribution (vision items that break the prior, text
    items: ``vision``, ``text``, ``all``) and, apart, ``vision_consistent``: vision items that follow it."""
    with_prior = TESTBED_RECIPES[name].prior_rate is not None
    sets = {"": make_perception_dataset(n_items, seed=seed, prior_rate=0.0 if with_prior else None)}
    if with_prior:
        sets["_consistent"] = make_perception_dataset(n_items, seed=seed, prior_rate=1.0)
    card = {}
    for ratio in ratios:
        condition = f"masked_{ratio}" if ratio else "original"
        for suffix, data in sets.items():
            prompts, answers, split = list(data["prompt"]), list(data["answer"]), list(data["vision_dependent"])
            images = list(data["image"])
            shown = [mask_pil_squares(im, ratio, seed=seed + i) for i, im in enumerate(images)] if ratio else images
            rewards = accuracy_reward(generate_answers(model, processor, prompts, shown, batch_size=32), answers)
            for split_name, keep in (("vision", True), ("text", False)) if not suffix else (("vision", True),):
                picked = [r for r, v in zip(rewards, split) if v == keep]
                card[f"{condition}/{split_name}{suffix}"] = sum(picked) / len(picked)
            if not suffix:
                card[f"{condition}/all"] = sum(rewards) / len(rewards)
    return card


def _write_testbed(folder: Path, name: str, seed: int) -> None:
    start = time.perf_counter()
    recipe = TESTBED_RECIPES[name]
    processor = build_tiny_processor("qwen2_vl")
    config = tiny_config("qwen2_vl", processor.tokenizer)
    threads = torch.get_num_threads()
    # One thread: CPU reductions then run in one fixed order, so the same seed gives the same weights.
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = FAMILIES["qwen2_vl"][1](config)
            stopped_at = []
            # mininterval: a handful of lines in a papermill log or a terminal, a widget in JupyterLab
            bar = tqdm(total=SFT_MAX_STEPS, desc=f"building testbed:{name} (warm start)", mininterval=10, unit="step")

            def stop_when_seeing(step: int) -> bool:
                if step % recipe.check_every:
                    return False
                check = score_card(model, processor, name, VALIDATION_ITEMS, VALIDATION_SEED, ratios=(0.0,))
                model.train()
                bar.set_postfix(vision_accuracy=f"{check['original/vision']:.2f}", goal=recipe.stop_vision_accuracy)
                if check["original/vision"] >= recipe.stop_vision_accuracy:
                    stopped_at.append(step)
                return bool(stopped_at)

            try:
                losses = warm_start(
                    model, processor, steps=SFT_MAX_STEPS, seed=seed, after_step=stop_when_seeing,
                    boxed_every=recipe.boxed_every, prior_rate=recipe.prior_rate, progress=lambda loss: bar.update(),
                )  # fmt: skip
            finally:
                bar.close()
            card = score_card(model, processor, name)
    finally:
        torch.set_num_threads(threads)
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(model.generation_config, key, getattr(config.text_config, key))
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    card = {
        "testbed": name,
        "seed": seed,
        "version": TESTBED_VERSION,
        "parameters": sum(p.numel() for p in model.parameters()),
        "sft_steps": len(losses),
        "sft_stopped_by_validation": bool(stopped_at),
        "stop_vision_accuracy": recipe.stop_vision_accuracy,
        "boxed_every": recipe.boxed_every,
        "prior_rate": recipe.prior_rate,
        "check_every": recipe.check_every,
        "sft_batch": SFT_BATCH,
        "sft_lr": SFT_LR,
        "sft_final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "chance_vision": CHANCE_VISION,
        "card_items": CARD_ITEMS,
        "greedy_accuracy": card,
        "build_seconds": time.perf_counter() - start,
    }
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")


def build_testbed(name: str = "shapes", seed: int = 0, cache_dir: str | Path | None = None) -> Path:
    """Build (or reuse) the warm-started testbed policy and return its folder, loadable with ``load_vlm``.

    Cached under ``<cache>/testbed-<name>-seed<seed>-v<version>`` (``~/.cache/papo_nb`` or ``PAPO_NB_CACHE``: one
    build per machine, shared by every run and clone) with a completion marker written last (see ``build_cached``).
    Its ``testbed_card.json`` holds the held-out accuracies measured at build time.
    """
    if name not in TESTBEDS:
        raise ValueError(f"testbed name={name!r} is unknown; allowed: {list(TESTBEDS)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    folder = root / f"testbed-{name}-seed{seed}-v{TESTBED_VERSION}"
    return build_cached(
        folder, lambda staging: _write_testbed(staging, name, seed), f"testbed={name} seed={seed} v={TESTBED_VERSION}"
    )


def read_card(folder: str | Path) -> dict:
    """The build-time card (accuracies, parameters, build seconds) of a testbed folder."""
    return json.loads((Path(folder) / CARD_FILE).read_text())
