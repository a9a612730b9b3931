"""Prefix sharing (``PAPOGConfig.prefix_sharing``): every forward through ``_get_per_token_logps_and_entropies`` as
packed rows, equal to TRL's plain forward in log-probs, entropies and gradients on tiny Qwen2-VL, Qwen2.5-VL and
Qwen3-VL; negative controls that break the mask or the positions fail by far; a ``trainer.train()`` round matches the
plain path; the round is shuffled by whole groups; unsupported calls fall back with their reason."""

import collections
import copy
import dataclasses

import numpy as np
import pytest
import torch
from float64_islands import lift_float32_islands
from peft import get_peft_model
from PIL import Image
from tiny_trainers import tiny_trainer, unit_params
from trl import GRPOTrainer
from trl.trainer.utils import shuffle_sequence_dict

from papo_nb.papo import PAPOGConfig, PAPOGTrainer
from papo_nb.papo.forward_plan import forward_plan
from papo_nb.prefix_sharing import attention_cost, grouped_attention, packed_head
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.prefix_sharing.common import core_model
from papo_nb.prefix_sharing.prompt_identity import group_samples
from papo_nb.testbed.models import build_tiny_vlm, load_vlm, vision_special_token_ids
from papo_nb.workbook.training.builder import lora_config

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# (log-probs and entropies: max abs error; gradients: per-parameter relative norm), per dtype. The float64 gradient
# bound covers the models' float32 islands and TRL 1.15+'s fused head, which round a float64 backward (9.9e-8
# measured); with the islands lifted, as below, float64 holds to FLOAT64_LIFTED (1.8e-15 at worst, three families).
TOLERANCE = {torch.float64: (1e-10, 1e-6), torch.float32: (1e-5, 1e-5)}
FLOAT64_LIFTED = 1e-12
MAX_COMPLETION = 6
TEMPERATURE = 0.7
# prompt: (text, image sizes (width, height)); completions: their lengths (1, and MAX_COMPLETION: cut at the maximum)
PROMPTS = [
    ("What shape is this?", [(112, 112)]),
    ("Count the red shapes in both pictures, then answer with one word only.", [(112, 112), (112, 56)]),
    ("Say hello.", []),  # a text-only row in an image batch
    ("What shape is this?", [(112, 112)]),  # prompt 0's text with another image: another group
]
COMPLETIONS = [(0, 1), (0, MAX_COMPLETION), (0, 3), (1, MAX_COMPLETION), (1, 2), (1, 4), (1, 1), (2, 2), (2, 6)]
COMPLETIONS += [(3, 3), (3, MAX_COMPLETION)]


def prompt_parts(processor, text, sizes, seed):
    """One prompt through the real processor: its ids, modality types, pixel rows and grids."""
    rng = np.random.default_rng(seed)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    chat = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    out = processor(text=[chat], images=images or None, return_tensors="pt")
    return dict(
        ids=out["input_ids"][0],
        types=out["mm_token_type_ids"][0],
        pixels=out.get("pixel_values"),
        grid=out.get("image_grid_thw"),
        n_images=len(images),
    )


def call_arguments(processor, prompts, completions, order, seed=0):
    """The parent's log-prob arguments for rows ``[prompt; completion]`` in ``order``, built as TRL builds them:
    prompts left-padded, completions right-padded (mask 0 after their length, junk tokens there, as a sampler leaves
    after the end of a sequence), each row its prompt's images."""
    generator = torch.Generator().manual_seed(seed)
    banned = set(vision_special_token_ids(processor))
    vocab = [t for t in range(len(processor.tokenizer)) if t not in banned]
    pad = processor.tokenizer.pad_token_id
    n_prompt = max(len(p["ids"]) for p in prompts)
    rows = []
    for prompt_index, length in completions:
        tokens = torch.tensor(vocab)[torch.randint(len(vocab), (length,), generator=generator)]
        rows.append((prompts[prompt_index], tokens))
    rows = [rows[i] for i in order]
    ids, mask, types = [], [], []
    for prompt, tokens in rows:
        left, right = n_prompt - len(prompt["ids"]), MAX_COMPLETION - len(tokens)
        junk = torch.tensor(vocab)[torch.randint(len(vocab), (right,), generator=generator)]
        ids.append(torch.cat([torch.full((left,), pad), prompt["ids"], tokens, junk]))
        mask.append(torch.cat([torch.zeros(left), torch.ones(len(prompt["ids"]) + len(tokens)), torch.zeros(right)]))
        types.append(torch.cat([torch.zeros(left, dtype=torch.long), prompt["types"], torch.zeros(MAX_COMPLETION)]))
    with_images = [p for p, _ in rows if p["n_images"]]
    return dict(
        input_ids=torch.stack(ids).long(),
        attention_mask=torch.stack(mask).long(),
        logits_to_keep=MAX_COMPLETION,
        compute_entropy=True,
        pixel_values=torch.cat([p["pixels"] for p in with_images]) if with_images else None,
        image_grid_thw=torch.cat([p["grid"] for p in with_images]) if with_images else None,
        num_images=[p["n_images"] for p, _ in rows],
        mm_token_type_ids=torch.stack(types).long(),
    )


def in_dtype(arguments, dtype):
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in arguments.items()
    }


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tiny_vlm_path, shapes_dataset, tmp_path_factory):
    """A tiny model of the family (every parameter trainable, no adapter), a trainer whose plain log-prob method is
    the reference (on its own copy), and a batch covering the cases, rows shuffled."""
    family = request.param
    folder = tiny_vlm_path if family == "qwen2_vl" else build_tiny_vlm(family, cache_dir=tmp_path_factory.mktemp("m"))
    return dict(family=family, **reference_setup(folder, shapes_dataset, tmp_path_factory.mktemp(f"ps_{family}")))


def reference_setup(folder, dataset, work) -> dict:
    """The tiny model saved in ``folder`` (``model``, in train mode: dropout is 0 in the tiny config, and train mode
    is what the loss sees), its ``processor``, a ``trainer`` (in ``work``, on its own copy of the model) whose plain
    log-prob method is the reference, and the batch covering the cases (``arguments``), rows shuffled (``order``)."""
    model, processor = load_vlm(str(folder))
    model.train()
    trainer_model, _ = load_vlm(str(folder))
    trainer = tiny_trainer(trainer_model, processor, dataset, work / "t", num_generations=3,
                           per_device_train_batch_size=9, prefix_sharing=True)  # fmt: skip
    trainer.temperature = TEMPERATURE
    prompts = [prompt_parts(processor, text, sizes, seed) for seed, (text, sizes) in enumerate(PROMPTS)]
    order = torch.randperm(len(COMPLETIONS), generator=torch.Generator().manual_seed(1)).tolist()
    arguments = call_arguments(processor, prompts, COMPLETIONS, order)
    return dict(model=model, processor=processor, trainer=trainer, arguments=arguments, order=order)


def plain(trainer, model, arguments):
    return GRPOTrainer._get_per_token_logps_and_entropies(trainer, model, **arguments)[:2]


def packed(model, arguments, entropy_grad=False):
    logps, entropies, _, _ = prefix_sharing.packed_logps_and_entropies(
        model, arguments, temperature=TEMPERATURE, entropy_grad=entropy_grad
    )
    return logps, entropies


def completion_mask(arguments):
    return arguments["attention_mask"][:, -MAX_COMPLETION:].bool()


def max_error(a, b, mask):
    return (a - b)[mask].abs().max().item()


# Each group's attention runs stacked or split, whichever computes fewer pairs (grouped_attention.py); the exactness
# tests force each form on every group, since this batch's short completions would pick split alone.
FORCED_FORMS = {"stacked": {"stacked": 0, "split": 1}, "split": {"stacked": 1, "split": 0}}


@pytest.fixture(params=sorted(FORCED_FORMS))
def form(request, monkeypatch):
    monkeypatch.setattr(grouped_attention, "grouped_forms", lambda *_: FORCED_FORMS[request.param])
    return request.param


def assert_layout_form(batch, form):
    masked = [call.allowed is not None for call in batch.layout.calls]
    assert (not any(masked)) if form == "stacked" else any(masked), (form, masked)


@pytest.mark.model
def test_the_batch_covers_every_case(setup):
    arguments, order = setup["arguments"], setup["order"]
    lengths = completion_mask(arguments).sum(1)
    assert {1, MAX_COMPLETION} <= set(lengths.tolist())
    prompt_lengths = arguments["attention_mask"][:, :-MAX_COMPLETION].sum(1)
    assert len(set(prompt_lengths.tolist())) == 3, "three prompts of unequal length"
    grids = [tuple(g.tolist()) for g in arguments["image_grid_thw"]]
    assert (1, 8, 8) in grids and (1, 4, 8) in grids, grids  # two images of different grids in one prompt
    assert 0 in arguments["num_images"] and 2 in arguments["num_images"]
    assert order != sorted(order)
    groups = group_samples({"prompt_ids": arguments["input_ids"][:, :-MAX_COMPLETION],
                            "prompt_mask": arguments["attention_mask"][:, :-MAX_COMPLETION],
                            "pixel_values": arguments["pixel_values"], "image_grid_thw": arguments["image_grid_thw"],
                            "num_images": arguments["num_images"]})  # fmt: skip
    assert sorted(map(len, groups)) == [2, 2, 3, 4] and any(g != sorted(g) or g[-1] - g[0] >= len(g) for g in groups)


@pytest.mark.model
# No fp64 eager: there the plain forward itself is NaN (measured: a left-padded row's fully masked query adds
# finfo(float64).min to negative scores, -inf throughout, and the NaN reaches real tokens through 0 * NaN values).
@pytest.mark.parametrize(
    ("dtype", "attention"),
    [(torch.float64, "sdpa"), (torch.float32, "sdpa"), (torch.float32, "eager")],
    ids=["fp64-sdpa", "fp32-sdpa", "fp32-eager"],
)
def test_logps_and_entropies_equal_the_plain_forward(setup, dtype, attention, form):
    tolerance = TOLERANCE[dtype][0]
    model = copy.deepcopy(setup["model"]).to(dtype)
    model.set_attn_implementation(attention)
    arguments = in_dtype(setup["arguments"], dtype)
    assert_layout_form(_packed_one(model, arguments), form)
    mask = completion_mask(arguments)
    with torch.no_grad():
        reference, ours = plain(setup["trainer"], model, arguments), packed(model, arguments)
    errors = [max_error(a, b, mask) for a, b in zip(ours, reference)]
    print(f"{setup['family']} {dtype} {attention} {form}: logps {errors[0]:.2e} entropies {errors[1]:.2e}")
    assert max(errors) <= tolerance
    assert ours[0].dtype == reference[0].dtype == dtype
    assert (ours[0][~mask] == 0).all() and (ours[1][~mask] == 0).all()  # dropped tokens: 0, never read


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_gradients_equal_the_plain_forward_per_parameter(setup, dtype, form, monkeypatch):
    tolerance = TOLERANCE[dtype][1]
    if dtype == torch.float64:  # float64 throughout: the models' float32 islands in float64 (float64_islands.py)
        lift_float32_islands(monkeypatch)
        tolerance = FLOAT64_LIFTED
    model = copy.deepcopy(setup["model"]).to(dtype)
    arguments = in_dtype(setup["arguments"], dtype)
    assert_layout_form(_packed_one(model, arguments), form)
    (reference, _), (ours, _) = (gradients(setup["trainer"], model, arguments, f) for f in ("plain", "packed"))
    worst = worst_relative_error(reference, ours)
    print(f"{setup['family']} {dtype} {form}: worst per-parameter relative gradient error {worst:.2e}")
    assert worst <= tolerance


def gradients(trainer, model, arguments, forward: str) -> tuple[dict, tuple]:
    """Every parameter's gradient of a fixed random weighting of the ``forward`` log-probs and entropies (with their
    graph, as the entropy bonus asks), and those ``(logps, entropies)``, detached. ``forward``: "plain" (TRL's
    method), "packed" (the packed path itself) or "hook" (the trainer's method: packed where sharing runs)."""
    mask = completion_mask(arguments).to(next(model.parameters()).dtype)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2), dtype=mask.dtype)
    model.zero_grad(set_to_none=True)
    if forward == "packed":
        logps, entropies = packed(model, arguments, entropy_grad=True)
    else:
        trainer._entropy_bonus_enabled = True
        try:
            if forward == "plain":
                logps, entropies = plain(trainer, model, arguments)
            else:
                logps, entropies, _ = trainer._get_per_token_logps_and_entropies(model, **arguments)
        finally:
            trainer._entropy_bonus_enabled = False
    ((logps * weights + 0.1 * entropies) * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, (logps.detach(), entropies.detach())


def worst_relative_error(reference: dict, ours: dict) -> float:
    """The largest per-parameter relative gradient error (the vision tower's among them)."""
    assert reference.keys() == ours.keys() and any("visual" in n for n in reference)
    return max(
        ((ours[n] - g).norm() / g.norm()).item() if g.norm() > 0 else ours[n].norm().item()
        for n, g in reference.items()
    )


def _packed_one(model, arguments):
    (batch,) = prefix_sharing.packed_batches(model, arguments)
    return batch


def _scatter(batch, values, arguments):
    out = torch.zeros(arguments["input_ids"].shape[0], MAX_COMPLETION, dtype=values.dtype)
    out[batch.rows, batch.columns] = values
    return out


@pytest.mark.model
@pytest.mark.parametrize("control", ["completion_leak", "positions_shifted"])
def test_negative_controls_fail_by_far(setup, control, form):
    """The exactness test can fail: a completion that sees another, or completion positions one off, moves the
    log-probs far beyond the fp32 tolerance (let alone fp64's)."""
    model = copy.deepcopy(setup["model"]).to(torch.float64)
    arguments = in_dtype(setup["arguments"], torch.float64)
    batch = _packed_one(model, arguments)
    inputs, segments = batch.model_inputs, batch.segments
    if control == "completion_leak":  # one segment for all completions of a group: each sees those before it
        leaking = grouped_attention.build_layout(batch.token_groups, segments[0].clamp(max=1))
        changed = {"attention_mask": {"full_attention": leaking}}
    else:  # every completion token one position later
        changed = {"position_ids": inputs["position_ids"] + (segments > 0).long()[None]}
    mutated = dataclasses.replace(batch, model_inputs={**inputs, **changed})
    with torch.no_grad():
        reference = plain(setup["trainer"], model, arguments)[0]
        exact = prefix_sharing.logps_of_packed(model, batch, temperature=TEMPERATURE, compute_entropy=False,
                                               entropy_grad=False)[0]  # fmt: skip
        broken = prefix_sharing.logps_of_packed(model, mutated, temperature=TEMPERATURE, compute_entropy=False,
                                                entropy_grad=False)[0]  # fmt: skip
    mask = completion_mask(arguments)
    exact_error = max_error(_scatter(batch, exact, arguments), reference, mask)
    broken_error = max_error(_scatter(batch, broken, arguments), reference, mask)
    print(f"{setup['family']} {control}: exact {exact_error:.2e}, broken {broken_error:.2e}")
    assert exact_error <= TOLERANCE[torch.float64][0]
    assert broken_error > 100 * TOLERANCE[torch.float32][0]


@pytest.mark.model
def test_the_trainer_hook_packs_and_falls_back_with_its_reason(setup, caplog, monkeypatch):
    trainer, model, arguments = setup["trainer"], setup["model"], setup["arguments"]
    monkeypatch.setattr(packed_head, "LOGIT_ROWS", 4)  # the vocabulary head in several pieces here
    metrics = trainer._metrics["train"]
    metrics[prefix_sharing.METRIC].clear()
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(model, **arguments)
        reference = plain(trainer, model, arguments)
    assert max_error(ours[0], reference[0], completion_mask(arguments)) <= TOLERANCE[torch.float32][0]
    assert metrics[prefix_sharing.METRIC] == [1.0] and metrics[prefix_sharing.SHARE_METRIC][-1] == 11 / 4
    gap = {**arguments, "attention_mask": arguments["attention_mask"].clone()}
    row = int(completion_mask(arguments).sum(1).argmax())
    gap["attention_mask"][row, -MAX_COMPLETION + 1] = 0  # a completion mask with a hole: not TRL's, not packed
    with caplog.at_level("WARNING", logger="papo_nb.prefix_sharing.sharing"), torch.no_grad():
        fallback = trainer._get_per_token_logps_and_entropies(model, **gap)
    assert torch.equal(fallback[0], plain(trainer, model, gap)[0]), "the fallback is the parent's method itself"
    assert metrics[prefix_sharing.METRIC] == [1.0, 0.0]
    assert "plain forward per completion, because a completion mask with a gap" in caplog.text


@pytest.mark.model
def test_a_per_sub_config_eager_text_model_runs_its_own_attention(setup, caplog):
    """The top level says sdpa, the text model runs eager: the grouped path reads the text config and runs eager's
    own function with its additive masks (a boolean mask added by eager lets completions see each other)."""
    model = copy.deepcopy(setup["model"])
    model.set_attn_implementation({"text_config": "eager", "vision_config": "sdpa"})
    assert model.config._attn_implementation == "sdpa"
    assert grouped_attention.text_config(model)._attn_implementation == "eager"
    assert prefix_sharing.unsupported_reason(model, 1) is None
    arguments, trainer = setup["arguments"], setup["trainer"]
    with torch.no_grad(), caplog.at_level("INFO", logger="papo_nb.prefix_sharing.sharing"):
        reference = plain(trainer, model, arguments)
        sharing = prefix_sharing.PrefixSharing(trainer.args, model, 1, {"train": collections.defaultdict(list)})
        ours = sharing.compute(model, arguments, temperature=TEMPERATURE, entropy_grad=False, training=True)
    errors = [max_error(a, b, completion_mask(arguments)) for a, b in zip(ours[:2], reference)]
    print(f"{setup['family']} eager text, sdpa vision: logps {errors[0]:.2e} entropies {errors[1]:.2e}")
    assert max(errors) <= TOLERANCE[torch.float32][0]
    assert "grouped attention through 'eager'" in caplog.text
    assert grouped_attention.text_config(model)._attn_implementation == "eager", "restored after the forward"


@pytest.mark.model
def test_a_call_without_mm_token_type_ids_runs_the_plain_forward_and_its_refusal(setup, caplog):
    """Qwen2-VL's and Qwen3-VL's plain forwards refuse images without modality types; Qwen2.5-VL's runs them without
    multimodal positions. The packed path never fills the types in: the call is the parent's, refusal or numbers
    alike."""
    trainer, model = setup["trainer"], setup["model"]
    arguments = {**setup["arguments"], "mm_token_type_ids": None}
    metrics = trainer._metrics["train"]
    metrics[prefix_sharing.METRIC].clear()
    with torch.no_grad(), caplog.at_level("WARNING", logger="papo_nb.prefix_sharing.sharing"):
        if setup["family"] in ("qwen2_vl", "qwen3_vl"):
            with pytest.raises(ValueError, match="`mm_token_type_ids` is missing"):
                trainer._get_per_token_logps_and_entropies(model, **arguments)
        else:
            ours = trainer._get_per_token_logps_and_entropies(model, **arguments)
            assert torch.equal(ours[0], plain(trainer, model, arguments)[0])
    assert metrics[prefix_sharing.METRIC] == [0.0]
    assert "because image_grid_thw without mm_token_type_ids" in caplog.text


@pytest.mark.model
def test_luspo_with_a_kl_runs_the_plain_forward_and_names_why(tiny_vlm_path, tmp_path):
    """TRL 1.9.1's luspo averages ``per_token_loss + beta * kl`` over every completion column, past each end
    included; the packed path leaves those at 0, so with ``beta != 0`` every call runs TRL's own forward."""
    model, _ = load_vlm(str(tiny_vlm_path))
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True, loss_type="luspo",
                  importance_sampling_level="sequence")  # fmt: skip
    metrics = {"train": collections.defaultdict(list)}
    with_kl = prefix_sharing.PrefixSharing(PAPOGConfig(**common, beta=0.04), model, 1, metrics)
    assert (
        with_kl.reason == "loss_type='luspo' with beta=0.04 (its aggregation reads the KL after each completion's end)"
    )
    assert with_kl.compute(model, {}, temperature=1.0, entropy_grad=False, training=True) is None
    assert metrics["train"][prefix_sharing.METRIC] == [0.0] and not with_kl.shuffles_whole_groups
    assert prefix_sharing.PrefixSharing(PAPOGConfig(**common, beta=0.0), model, 1, metrics).reason is None


# Qwen2.5-VL-3B's text model (config.json of Qwen/Qwen2.5-VL-3B-Instruct): hidden 2048, MLP 11008, 16 heads, 2 KV
# heads of 128, 36 layers.
QWEN25_VL_3B = attention_cost.TextWidths(
    hidden=2048, intermediate=11008, heads=16, kv_heads=2, head_dim=128, layers=36
)


def test_the_attention_cost_model_gives_the_issues_figures_and_grouped_never_costs_more():
    """The dense W x W layout cost 0.32 / 0.73 / 1.15 / 1.79 of the plain forward at P 1100, G 8, R 256 to 4096
    and 1.09 at P 300, R 1024 (issue 42); grouped attention stays below 1 at every shape."""
    issue = {(1100, 256): 0.32, (1100, 1024): 0.73, (1100, 2048): 1.15, (1100, 4096): 1.79, (300, 1024): 1.09}
    for (prompt, completion), dense in issue.items():
        cost = attention_cost.per_group(QWEN25_VL_3B, prompt, completion, 8)
        assert cost["dense_packed"] / cost["plain"] == pytest.approx(dense, abs=0.005)
        assert cost["grouped"] < min(cost["plain"], cost["dense_packed"])
    for prompt in (1, 16, 300, 4096):
        for completion in (1, 16, 1024, 8192):
            for group in (1, 2, 5, 8, 64):
                for padded in (True, False):  # against the masked plain call and the causal one that skips blocks
                    cost = attention_cost.per_group(QWEN25_VL_3B, prompt, completion, group, padded=padded)
                    assert cost["grouped"] <= cost["plain"], (prompt, completion, group, padded)


@pytest.mark.model
def test_the_cost_guard_counts_the_calls_pairs_and_runs_plain_where_sharing_would_cost_more(
    setup, caplog, monkeypatch
):
    trainer, model, arguments = setup["trainer"], setup["model"], setup["arguments"]
    (batch,) = prefix_sharing.packed_batches(model, arguments)
    n_prompt = arguments["input_ids"].shape[1] - MAX_COMPLETION
    lengths = completion_mask(arguments).sum(1).tolist()
    groups = group_samples({"prompt_ids": arguments["input_ids"][:, :n_prompt],
                            "prompt_mask": arguments["attention_mask"][:, :n_prompt],
                            "pixel_values": arguments["pixel_values"], "image_grid_thw": arguments["image_grid_thw"],
                            "num_images": arguments["num_images"]})  # fmt: skip
    expected_pairs = 0
    for group in groups:  # per group the cheaper form, counted here from the batch's own lengths
        prompt = int(arguments["attention_mask"][group[0], :n_prompt].sum())
        packed = [lengths[row] - 1 for row in group if lengths[row] > 1]  # a completion's last token is not packed
        forms = attention_cost.grouped_forms(prompt, max(packed), len(packed)) if packed else None
        expected_pairs += min(forms.values()) if forms else attention_cost.causal_pairs(prompt)
    assert batch.layout.pairs == expected_pairs
    widths = attention_cost.TextWidths.of(grouped_attention.text_config(model))
    vision = attention_cost.VisionWidths.of(core_model(model).config.vision_config)
    rows, width = arguments["input_ids"].shape
    tokens = batch.segments.shape[1]
    # the head on every needed position, the tower on each row's image (plain) or each group's (packed)
    grids = arguments["image_grid_thw"]
    assert len(batch.model_inputs["image_grid_thw"]) < len(grids)  # each group's images once, not each row's
    plain_extra = widths.head_flops(rows * MAX_COMPLETION) + sum(vision.image_flops(int(n)) for n in grids.prod(-1))
    packed_grids = batch.model_inputs["image_grid_thw"]
    shared_extra = widths.head_flops(len(batch.targets)) + sum(
        vision.image_flops(int(n)) for n in packed_grids.prod(-1)
    )
    expected = (widths.flops(tokens, batch.layout.pairs) + shared_extra) / (
        widths.flops(rows * width, rows * width**2) + plain_extra
    )
    assert prefix_sharing.predicted_cost_ratio(model, arguments, [batch]) == pytest.approx(expected) and expected < 1
    metrics = trainer._metrics["train"]
    for key in (prefix_sharing.METRIC, prefix_sharing.COST_METRIC):
        metrics[key].clear()
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(model, **arguments)
    assert metrics[prefix_sharing.METRIC] == [1.0] and metrics[prefix_sharing.COST_METRIC] == [pytest.approx(expected)]
    # A layout costing more than the plain rows (the dense W x W one did at long completions) must run plain.
    monkeypatch.setattr(prefix_sharing, "predicted_cost_ratio", lambda *args: 2.0)
    with torch.no_grad(), caplog.at_level("WARNING", logger="papo_nb.prefix_sharing.sharing"):
        guarded = trainer._get_per_token_logps_and_entropies(model, **arguments)
        assert torch.equal(guarded[0], plain(trainer, model, arguments)[0])
    assert metrics[prefix_sharing.METRIC] == [1.0, 0.0] and metrics[prefix_sharing.COST_METRIC][-1] == 2.0
    assert "because the FLOP model predicts the packed forward would cost more than the plain one" in caplog.text


@pytest.mark.model
def test_the_forward_plan_names_each_forward_from_the_trainers_choices(setup, tmp_path):
    trainer = setup["trainer"]
    plan = trainer.forward_plan
    assert plan.log_prob_forward == "packed per prompt group" and plan.masked_branch == "once per generation round"
    assert (
        plan.masked_forward == "prefill per prompt, no grad" and plan.masked_forward_reason == "masked_forward='auto'"
    )
    assert plan.describe().endswith(
        "log-prob forwards packed per prompt group (prefix_sharing=True, supported here; grouped attention through "
        "'sdpa', gradient checkpointing off)"
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.log_prob_forward = "plain per completion"
    luspo = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True, loss_type="luspo",
                        importance_sampling_level="sequence", beta=0.04)  # fmt: skip
    sharing = prefix_sharing.PrefixSharing(luspo, setup["model"], 1, {"train": collections.defaultdict(list)})
    plain_plan = forward_plan(luspo, trainer.masked_branch, sharing)
    assert plain_plan.log_prob_forward == "plain per completion" and "luspo" in plain_plan.log_prob_reason


def test_unsupported_models_and_runs_fall_back_with_their_reason(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text_model = Qwen2ForCausalLM(
        Qwen2Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1)
    )  # fmt: skip
    args = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True)
    sharing = prefix_sharing.PrefixSharing(args, text_model, 1, {"train": collections.defaultdict(list)})
    assert "model_type 'qwen2'" in sharing.reason and not sharing.shuffles_whole_groups
    assert sharing.compute(text_model, {}, temperature=1.0, entropy_grad=False, training=True) is None
    off = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=False)
    assert not prefix_sharing.PrefixSharing(off, text_model, 1, {}).enabled


@pytest.mark.model
def test_unsupported_processes_and_attention_are_named(tiny_vlm_path, tmp_path):
    model, _ = load_vlm(str(tiny_vlm_path))
    assert prefix_sharing.unsupported_reason(model, 1) is None
    assert prefix_sharing.unsupported_reason(model, 2) is None, "each rank packs its own groups (ranks.py)"
    model.model.language_model.config._attn_implementation = "flash_attention_2"
    assert model.config._attn_implementation == "sdpa", "the top level still says sdpa"
    reason = prefix_sharing.unsupported_reason(model, 1)
    assert "text_config._attn_implementation='flash_attention_2'" in reason and "('sdpa', 'eager')" in reason


def test_batch_sizes_without_whole_groups_are_refused(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"prefix_sharing=True is invalid with per_device_train_batch_size=6 and "
        r"num_generations=4: .* allowed: per_device_train_batch_size a multiple of num_generations",
    ):
        PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing=True,
                    per_device_train_batch_size=6, num_generations=4, generation_batch_size=12)  # fmt: skip
    with pytest.raises(ValueError, match=r"prefix_sharing='yes' is invalid: expected one of \('auto', True, False\)"):
        PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, prefix_sharing="yes")


def test_the_round_shuffle_keeps_blocks_whole():
    blocks = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3])
    batch = {prefix_sharing.BLOCK_KEY: blocks, "x": torch.arange(12), "names": list("abcdefghijkl"),
             "owner": torch.tensor(7), "none": None}  # fmt: skip
    torch.manual_seed(0)
    out = prefix_sharing.shuffle_whole_blocks(batch)
    after_ours = torch.get_rng_state()
    torch.manual_seed(0)
    shuffle_sequence_dict(batch)
    assert torch.equal(after_ours, torch.get_rng_state()), "the same draw as TRL's: the run's random stream is TRL's"
    assert out["owner"] is batch["owner"] and out["none"] is None
    assert [batch["names"][i] for i in out["x"].tolist()] == out["names"]
    chunks = out[prefix_sharing.BLOCK_KEY].view(4, 3)
    assert (chunks == chunks[:, :1]).all() and sorted(chunks[:, 0].tolist()) == [0, 1, 2, 3]
    assert out[prefix_sharing.BLOCK_KEY].tolist() != blocks.tolist(), "the blocks are shuffled (seed 0)"


class PlainForwardWholeGroups(PAPOGTrainer):
    """The reference of the training test: the whole-group shuffle of prefix sharing, TRL's plain forward."""

    def _logps_and_entropies(self, *args, **kwargs):
        return GRPOTrainer._get_per_token_logps_and_entropies(self, *args, **kwargs)


def one_round(tiny_vlm_path, dataset, out, trainer_cls=PAPOGTrainer, **overrides):
    """One generation round of 4 prompts x 4 completions: 2 optimizer steps of 2 micro-batches, each round's rows
    seen twice (num_iterations 2: old log-probs are computed), reference KL on (beta 0.01: the reference forward)."""
    model, processor = load_vlm(str(tiny_vlm_path))
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(unit_params()))
    settings = dict(
        num_generations=4, per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=2,
        num_iterations=2, beta=0.01, max_steps=2, logging_steps=1, prefix_sharing=True,
    )  # fmt: skip
    trainer = tiny_trainer(model, processor, dataset, out, trainer_cls, **{**settings, **overrides})
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    return trainer, start, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize(
    "branch",
    [dict(), dict(masked_branch="update", masked_branch_grad=True, masked_entropy_weight=0.03)],
    ids=["rollout_branch", "update_branch_with_grad"],
)  # the second sends the masked branch's gradient forward through the packed rows too
def test_a_training_round_matches_the_plain_forward(tiny_vlm_path, shapes_dataset, tmp_path, branch):
    shared, start, after = one_round(tiny_vlm_path, shapes_dataset, tmp_path / "shared", **branch)
    reference, _, expected = one_round(
        tiny_vlm_path, shapes_dataset, tmp_path / "plain", PlainForwardWholeGroups, **branch
    )
    moved = max((after[n] - start[n]).abs().max().item() for n in start)
    diff = max((after[n] - expected[n]).abs().max().item() for n in start)
    print(f"training round: parameters moved by up to {moved:.2e}, packed vs plain differ by {diff:.2e}")
    assert moved > 10 * 1e-5 and diff <= 1e-5  # the round moves the parameters well past the tolerance
    logged = [h for h in shared.state.log_history if prefix_sharing.METRIC in h]
    assert logged and all(h[prefix_sharing.METRIC] == 1.0 for h in logged)
    assert not any(prefix_sharing.METRIC in h for h in reference.state.log_history)
    # every micro-batch of the round held whole groups of 4 (the buffered round of the last step)
    for batch in shared._buffered_inputs:
        assert sorted(map(len, group_samples(batch))) == [4, 4]


@pytest.mark.model
@pytest.mark.slow
def test_gamma_zero_probe_and_per_term_metrics_with_sharing_on(tiny_vlm_path, shapes_dataset, tmp_path):
    trainer, _, _ = one_round(
        tiny_vlm_path, shapes_dataset, tmp_path / "probe", require_gpu_contract_probe=True, num_iterations=1,
    )  # fmt: skip
    assert trainer.probe.evidence.passed, trainer.probe.evidence.message
    history = trainer.state.log_history
    assert any(h.get("probe/passed") == 1.0 for h in history)
    terms = [h for h in history if "perception_kl" in h]
    assert terms and all(h["perception_kl"] > 0 and "papo/gamma_kl" in h and "papo/parent_loss" in h for h in terms)
    assert all(h[prefix_sharing.METRIC] == 1.0 for h in history if prefix_sharing.METRIC in h)


def train_and_evaluate(tmp_path, sharing: bool) -> dict:
    """``papo-nb train --params params/smoke.yaml -p prefix_sharing=...`` as a user runs it, then notebook 03's
    held-out evaluation of its last checkpoint."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from mlflow import MlflowClient

    from papo_nb.infra.tracking import EXPERIMENT_NAME
    from papo_nb.workbook.config.params import load_params
    from papo_nb.workbook.evaluation.heldout import evaluate_image_reliance
    from papo_nb.workbook.training.builder import load_datasets, load_policy
    from papo_nb.workbook.training.checkpoints import latest_checkpoint, load_trainable_adapter

    root = Path(__file__).resolve().parents[1]
    smoke, out = root / "params" / "smoke.yaml", tmp_path / f"run_{sharing}"
    command = [sys.executable, "-m", "papo_nb.cli", "train", "--params", str(smoke), "--output-dir", str(out)]
    command += ["-p", f"prefix_sharing={str(sharing).lower()}"]
    uri = f"sqlite:///{tmp_path}/mlflow_{sharing}.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(root)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(EXPERIMENT_NAME).experiment_id])
    packed = [m.value for m in client.get_metric_history(run.info.run_id, prefix_sharing.METRIC)]
    assert (packed and set(packed) == {1.0}) if sharing else not packed, packed
    params = load_params(smoke)
    model, processor = load_policy(params)
    model, _ = load_trainable_adapter(model, latest_checkpoint(out))
    return evaluate_image_reliance(model, processor, load_datasets(params)[1], mask_ratio=params.mask_ratio,
                                   seed=params.seed, max_new_tokens=params.max_completion_length)  # fmt: skip


@pytest.mark.model
@pytest.mark.slow
def test_papo_nb_train_with_sharing_reaches_the_plain_held_out_accuracy(tmp_path):
    """The smoke testbed trained by ``papo-nb train`` (same seed) with and without prefix sharing: the held-out
    greedy accuracy within one binomial standard error of the held-out items (seed noise), both far above chance."""
    plain_run, shared_run = train_and_evaluate(tmp_path, False), train_and_evaluate(tmp_path, True)
    print(f"held-out accuracy: plain {plain_run}, shared {shared_run}")
    p, items = plain_run["accuracy_original"], plain_run["items"]
    noise = (p * (1 - p) / items) ** 0.5
    assert abs(shared_run["accuracy_original"] - p) <= max(noise, 1 / items), (plain_run, shared_run)
    assert min(p, shared_run["accuracy_original"]) >= 0.5


def test_the_flop_model_of_sharing_is_the_issues():
    """rho = (P + G R) / (G (P + R)): 0.36 at P = 4R, G = 5 and 0.30 at G = 8; with the masked branch and one
    old-log-prob forward (3 steps per round) PAPO-G costs 0.45 and 0.375 of TRL's GRPO step."""
    from papo_nb.bench.in_loop_measure import flop_ratio

    expected = {5: (0.36, 0.45), 8: (0.30, 0.375)}
    for group, (grpo, papo) in expected.items():
        assert flop_ratio("grpo_shared", 4.0, 1.0, group, 3) == pytest.approx(grpo)
        assert flop_ratio("papo_shared", 4.0, 1.0, group, 3) == pytest.approx(papo)
    assert flop_ratio("papo_rollout", 4.0, 1.0, 5, 1) == pytest.approx(1 + 0.36 / 3)
