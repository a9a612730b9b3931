"""The FLOP model of one optimizer step at true widths, per phase, beside ``true_width``'s measurement.

Each forward is what ``attention_cost`` counts for a log-prob call (``prefix_sharing="auto"``'s model): the text
decoder (plain rows unpadded, completions run to full length here; or one grouped row), the vocabulary head on every
completion token (both paths alike) and the vision tower on the images (G on the plain path, one on the shared). At
the one or two layers a CPU trains at true widths the head (2,048 x 151,936 per completion token, four decoder
layers' worth) and the tower are much of a step; at full depth the decoder is most of it.

Phases, in forwards of each part: the training forward and backward (LoRA: decoder linear x3 (forward, checkpointing's
recompute, input gradient), attention x4 (its backward is two products), head x2, tower x3; full fine-tuning adds
the weight gradients: decoder x4, head x3, tower x4). The tower's x3 under LoRA, where nothing in it trains, is what
the first measurement showed (K 1, R 256: the plain backward took 18 CPU s more than a tower without backward
allows): ``enable_input_require_grads``, which TRL calls for checkpointing with PEFT, hooks every input embedding
of the model, the vision tower's patch embedding among them, so the checkpointed tower is recomputed and
differentiated in every backward though no weight of it trains; sharing runs that once per group too. The reference
log-probs (beta > 0, one no-grad forward); the masked branch (once per round, a no-grad prefill per prompt on both
variants: one image, the prompt once, G completions; the same on both). The old log-probs are not in these cells
(one optimizer step per round: TRL skips them); at several steps per round they cost one no-grad forward, as the
reference does.
"""

from __future__ import annotations

from typing import Any

from papo_nb.prefix_sharing import attention_cost


def parts(config, P: float, R: float, G: int, patches: int) -> dict[str, dict[str, float]]:
    """Forward FLOPs of one prompt group per part and path (``plain``: G rows; ``shared``: one packed group)."""
    widths = attention_cost.TextWidths.of(config.get_text_config())
    vision = attention_cost.VisionWidths.of(config.vision_config)
    decoder = attention_cost.per_group(widths, round(P), round(R), G, padded=False)
    pairs = {
        "plain": G * attention_cost.causal_pairs(round(P + R)),
        "shared": min(attention_cost.grouped_forms(round(P), round(R), G).values()),
    }
    return {
        path: dict(
            decoder=decoder[key],
            attention_share=pairs[path] * widths.pair_flops / decoder[key],
            head=widths.head_flops(G * R),
            vision=vision.image_flops(patches) * n,
        )  # fmt: skip
        for path, key, n in (("plain", "plain", G), ("shared", "grouped", 1))
    }


def phase_flops(p: dict[str, float], phase: str, finetuning: str) -> float:
    """FLOPs of one ``phase`` from one path's forward parts ``p``."""
    if phase in ("reference", "masked"):
        return p["decoder"] + p["head"] + p["vision"]
    full = finetuning == "full"
    linear, attention = p["decoder"] * (1 - p["attention_share"]), p["decoder"] * p["attention_share"]
    head, vision = p["head"] * (3 if full else 2), p["vision"] * (4 if full else 3)
    return linear * (4 if full else 3) + attention * 4 + head + vision


def step(config, cell, P: float, R: float) -> dict[str, Any]:
    """Per phase and per variant, the step's FLOPs, and the ratios shared/plain PAPO-G and shared/GRPO."""
    G = cell.num_generations
    patches = cell.max_pixels // config.vision_config.patch_size**2
    by_path = parts(config, P, R, G, patches)
    masked = phase_flops(by_path["shared"], "masked", cell.finetuning)  # a prefill per prompt on both variants
    phases = {
        path: dict(
            training=phase_flops(p, "training", cell.finetuning),
            reference=phase_flops(p, "reference", cell.finetuning),
            masked=masked,
        )
        for path, p in by_path.items()
    }
    grpo = phases["plain"]["training"] + phases["plain"]["reference"]
    plain, shared = (sum(phases[path].values()) for path in ("plain", "shared"))
    return dict(
        flops=phases,
        phase_shared_over_plain={k: phases["shared"][k] / phases["plain"][k] for k in phases["plain"]},
        shared_over_plain=shared / plain,
        shared_over_grpo=shared / grpo,
        plain_over_grpo=plain / grpo,
        decoder_only_shared_over_plain=by_path["shared"]["decoder"] / by_path["plain"]["decoder"],
    )


def prediction(config, cell, P: float, R: float) -> dict[str, Any]:
    """The step model at the cell's depth (``config``) and extrapolated to the published depth (Qwen2.5-VL-3B: 36
    decoder layers, 32 vision blocks) at the same tokens."""
    from papo_nb.workbook.recipe.architectures import published_config

    full = step(published_config(cell.family), cell, P, R)
    return dict(
        step=step(config, cell, P, R),
        full_depth={k: full[k] for k in ("shared_over_plain", "shared_over_grpo", "phase_shared_over_plain")},
    )
