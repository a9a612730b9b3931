"""Notebook 04's parameters (the method study), a part of the workbook's schema (``params.WorkbookParams``): its seeds,
its two designs (the dose-response sweep, or the calibrated design's collapse-gamma search and arms at fractions of
it), the matched controls, the paper's remedy for collapse and the values the study runs with in place of the
workbook's (``study_params``, applied by ``params.study_params_applied``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveFloat


class StudyParams(BaseModel):
    """The method study's fields of the workbook parameters (notebook 04)."""

    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)

    # defaults: the reduced study of a notebook run by hand
    study_seeds: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="seeds of every study arm (paired: the same seeds, data and masks in each arm); paper-style "
        "evidence needs at least 3",
    )
    study_collapse_gammas: list[NonNegativeFloat] = Field(
        default_factory=lambda: [1.0],
        min_length=1,
        description="gammas of the dose-response sweep, each trained at every study seed; the smallest flagged by "
        "the collapse detector on most seeds is the collapse arm, or the largest when none collapses",
    )
    study_gamma_fractions: list[PositiveFloat] = Field(
        default_factory=list,
        description="fractions of the collapse gamma the PAPO-G arms run at, beside GRPO and the recipe's gamma "
        "(the paper's recipe sits at 1/2 of it); the collapse gamma is then searched on the first seed, "
        "study_collapse_gammas in turn and a bisection below the first collapse; empty: the sweep design (every "
        "study_collapse_gammas at every seed)",
    )
    study_search_steps: int = Field(
        2, ge=0, le=8, description="bisection steps (geometric midpoints) of the collapse-gamma search"
    )
    study_collapse_gamma: PositiveFloat | None = Field(
        None, description="calibrated design: this warm start's collapse gamma as an earlier search found it (a "
        "published page's, its source named where it is set), taken without a search run; None: searched here",
    )  # fmt: skip
    study_entropy_weights: list[PositiveFloat] = Field(
        default_factory=list, description="calibrated design: the paper's remedy for collapse, PAPO-G with the double "
        "entropy loss (original_entropy_weight = masked_entropy_weight = each weight; the official 7B recipe: "
        "0.05), at study_entropy_fractions of the collapse gamma and, with study_recipe_arm, at the recipe's gamma; "
        "empty: none",
    )  # fmt: skip
    study_entropy_fractions: list[PositiveFloat] = Field(
        default_factory=list, description="calibrated design: fractions of the collapse gamma the double-entropy "
        "arms run at (params/study_calibrated.yaml: 0.5 and 1.0); empty: the recipe's gamma alone",
    )  # fmt: skip
    study_recipe_arm: bool = Field(
        True, description="calibrated design: also PAPO-G at the recipe's gamma (perception_loss_weight) at every "
        "seed, beside the fractions of the collapse gamma",
    )  # fmt: skip
    study_search_seed: int | None = Field(
        None, description="seed of the collapse-gamma and control searches, one no arm uses, so no arm is "
        "scored on the run its gamma or control setting was chosen on; None: the first study seed",
    )  # fmt: skip
    study_control_betas: list[PositiveFloat] = Field(
        default_factory=list, description="calibrated design: ladder of beta values for the GRPO control held back "
        "by the reference KL, matched to the strongest PAPO-G arm's end reward (study.controls); empty: no control",
    )  # fmt: skip
    study_control_learning_rates: list[PositiveFloat] = Field(
        default_factory=list, description="calibrated design: ladder of learning rates for the GRPO control held "
        "back by a smaller step, matched like study_control_betas; empty: no control",
    )  # fmt: skip
    study_eval_samples: int = Field(
        4, ge=1, le=64, description="k of the held-out avg@k at temperature 1.0 (paper: avg@8)"
    )
    study_vppo: bool = Field(
        False,
        description="also train a VPPO arm at every study seed (method 'vppo' at gamma 0 with vppo_token_fraction "
        "and vppo_advantage_scale_min; everything else as the GRPO arm), paired with GRPO and PAPO-G",
    )
    study_report_dir: str = Field(
        "", description="folder the study writes its results page into (docs/study/<name>); empty: none"
    )
    study_params: dict[str, Any] = Field(
        default_factory=dict,
        description="04 method study: parameters it runs with in place of the workbook's (another testbed, its "
        "steps and batch), each a field of this schema and validated with the rest before anything runs; empty: "
        "the workbook's",
    )
