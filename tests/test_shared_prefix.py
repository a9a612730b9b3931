"""The shared-prefix masked forward equals the full forward, for every family it supports, and the adapter's loss
with it; it falls back, with its reason in the metrics, where it does not apply."""

import copy
import weakref

import pytest
import torch
from peft import get_peft_model
from tiny_trainers import tiny_trainer, unit_params
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from trl import GRPOTrainer

from papo_nb.papo import PAPOGConfig
from papo_nb.papo import prefill as shared_prefix
from papo_nb.papo.logp_inputs import logp_call_arguments
from papo_nb.prefix_sharing import image_rows
from papo_nb.testbed.models import build_tiny_vlm, load_vlm
from papo_nb.workbook.rollouts import rollout_batch
from papo_nb.workbook.training.builder import lora_config

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
FP32_TOL = 1e-5
FP64_TOL = 1e-10
# Rows of a 3-prompt x 4-completion rollout batch, shuffled, so that the groups are of sizes 4, 1 and 2 (rows
# 0-3, 5, and 9/11): left-padded and unpadded prompts (the prompt kinds differ in length) in one device batch.
UNEQUAL_ROWS = [5, 0, 9, 1, 2, 3, 11]


def select_rows(batch, rows):
    """The ``_compute_loss`` batch of ``rows`` only (pixel rows and grids follow their samples)."""
    ranges = image_rows.sample_row_ranges(batch["image_grid_thw"], batch["num_images"])
    offsets = torch.tensor([0, *batch["num_images"]]).cumsum(0).tolist()
    out = {k: v[rows] for k, v in batch.items() if isinstance(v, torch.Tensor) and v.dim() > 0 and len(v) == 12}
    out["pixel_values"] = torch.cat([batch["pixel_values"][ranges[i][0] : ranges[i][1]] for i in rows])
    out["image_grid_thw"] = torch.cat([batch["image_grid_thw"][offsets[i] : offsets[i + 1]] for i in rows])
    out["num_images"] = [batch["num_images"][i] for i in rows]
    out["num_items_in_batch"] = out["completion_mask"].sum()
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def setup(request, tiny_vlm_path, shapes_dataset, tmp_path_factory):
    """A tiny model of the family with a LoRA adapter that is not zero (so the adapter's path is checked too), a
    PAPO-G trainer on it, and a batch of 12 rollouts (3 prompts x 4) with one completion cut short."""
    family = request.param
    folder = tiny_vlm_path if family == "qwen2_vl" else build_tiny_vlm(family, cache_dir=tmp_path_factory.mktemp("m"))
    model, processor = load_vlm(str(folder))
    torch.manual_seed(0)
    model = get_peft_model(model, lora_config(unit_params()))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    work = tmp_path_factory.mktemp(f"shared_{family}")
    trainer = tiny_trainer(
        model, processor, shapes_dataset, work / "t", num_generations=4, per_device_train_batch_size=12
    )
    batch = rollout_batch(trainer, shapes_dataset, 3, seed=0)
    # one completion ends early (as after an EOS: pad ids, mask 0), so completion lengths surely differ
    pad = processor.tokenizer.pad_token_id
    batch["completion_mask"][1, 3:] = 0
    batch["completion_ids"][1, 3:] = pad
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return dict(family=family, model=model, processor=processor, trainer=trainer, batch=batch, work=work)


def full_forward(trainer, model, batch, pixel_values):
    positional, kwargs = logp_call_arguments(batch)
    kwargs["pixel_values"] = pixel_values
    with torch.no_grad():
        logps, entropies, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, *positional, compute_entropy=True, **kwargs
        )
    return logps, entropies


def max_errors(shared, full, mask):
    mask = mask.bool()
    return tuple((a.double() - b.double())[mask].abs().max().item() for a, b in zip(shared, full))


@pytest.mark.model
def test_batch_has_padding_unequal_lengths_and_unequal_groups(setup):
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    assert (batch["prompt_mask"] == 0).any() and (batch["prompt_mask"].sum(1) == batch["prompt_mask"].shape[1]).any()
    assert len(set(batch["completion_mask"].sum(1).tolist())) > 1
    groups = shared_prefix.prompt_groups(batch, batch["pixel_values"])
    assert sorted(map(len, groups)) == [1, 2, 4], groups


@pytest.mark.model
@pytest.mark.parametrize("rows", [list(range(12)), UNEQUAL_ROWS], ids=["3x4", "groups_4_1_2"])
@pytest.mark.parametrize("max_chunk_rows", [None, 1, 12])
def test_shared_prefix_equals_full_forward_fp32(setup, rows, max_chunk_rows):
    trainer, model = setup["trainer"], setup["model"]
    batch = select_rows(setup["batch"], rows)
    masked = trainer.masked_pixel_values(batch)
    full = full_forward(trainer, model, batch, masked)
    shared = shared_prefix.shared_prefix_logps(
        model, batch, masked, temperature=trainer.temperature, compute_entropy=True, max_chunk_rows=max_chunk_rows
    )
    logp_error, entropy_error = max_errors(shared, full, batch["completion_mask"])
    print(f"{setup['family']} fp32 rows={len(rows)} chunk={max_chunk_rows}: {logp_error:.2e} {entropy_error:.2e}")
    assert logp_error <= FP32_TOL and entropy_error <= FP32_TOL
    # the masked image matters (a wrong image or position would move these far more than the tolerance)
    unmasked = full_forward(trainer, model, batch, batch["pixel_values"])
    assert max_errors(unmasked, full, batch["completion_mask"])[0] > 100 * FP32_TOL


@pytest.mark.model
def test_shared_prefix_equals_full_forward_fp64(setup):
    """In float64 the prefill and its copied cache leave only float64 roundoff: within FP64_TOL of the full forward
    (unequal groups, left-padded and unpadded prompts), the same masked image."""
    trainer = setup["trainer"]
    model = copy.deepcopy(setup["model"]).to(torch.float64)
    batch = {k: v.to(torch.float64) if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in select_rows(setup["batch"], UNEQUAL_ROWS).items()}  # fmt: skip
    masked = trainer.masked_pixel_values(batch).to(torch.float64)
    full = full_forward(trainer, model, batch, masked)
    shared = shared_prefix.shared_prefix_logps(
        model, batch, masked, temperature=trainer.temperature, compute_entropy=True
    )
    assert shared[0].dtype == full[0].dtype == torch.float64
    errors = max_errors(shared, full, batch["completion_mask"])
    print(f"{setup['family']} fp64: logps {errors[0]:.2e} entropies {errors[1]:.2e}")
    assert max(errors) <= FP64_TOL


@pytest.mark.model
def test_vision_tower_and_prompt_run_once_per_prompt(setup):
    """The saving is real: the vision tower sees each prompt's image once, the language model each prompt once."""
    model = setup["model"]
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    hf_model = shared_prefix.core_model(model)
    seen = {"vision_rows": 0, "text_rows": []}
    vision = hf_model.model.visual
    hooks = [
        vision.register_forward_pre_hook(
            lambda m, a, kw: seen.update(vision_rows=seen["vision_rows"] + len(a[0])), with_kwargs=True
        ),
        hf_model.model.language_model.register_forward_pre_hook(
            lambda m, a, kw: seen["text_rows"].append(tuple(kw["inputs_embeds"].shape[:2])), with_kwargs=True
        ),
    ]
    try:
        shared_prefix.shared_prefix_logps(model, batch, batch["pixel_values"], temperature=1.0, compute_entropy=False)
    finally:
        for hook in hooks:
            hook.remove()
    rows_per_image = int(batch["image_grid_thw"][0].prod())
    assert seen["vision_rows"] == 3 * rows_per_image  # 3 distinct prompts, not 7 completions
    prompt_len, completion_len = batch["prompt_ids"].shape[1], batch["completion_ids"].shape[1]
    assert seen["text_rows"][0] == (3, prompt_len)
    assert sum(n for n, _ in seen["text_rows"][1:]) == 7 and {t for _, t in seen["text_rows"][1:]} == {
        completion_len - 1
    }


# bf16 (both families, two mask draws): log-probs differ from the full forward's by at most 0.031 (one bf16 step at
# magnitudes 4 to 8), entropies by up to 0.125, while each path's own error against the fp32 forward is up to 0.031
# (log-probs) and 0.094 (entropies), mean 0.010-0.012 and 0.038-0.044, the shared path's within 1.01x of the full's.
# Bounds: the shared path's mean and max error against fp32 within 1.2x the full forward's; log-probs within two bf16
# steps of the full forward's, entropies within twice the full forward's own max error.
BF16_LOGP_MAX_DIFF = 2 * 2.0**-5
BF16_ERROR_RATIO = 1.2


@pytest.mark.model
def test_shared_prefix_in_bf16_adds_no_error_of_its_own(setup):
    trainer = setup["trainer"]
    model = copy.deepcopy(setup["model"]).to(torch.bfloat16)
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    masked = trainer.masked_pixel_values(batch)
    reference = full_forward(trainer, setup["model"], batch, masked)  # fp32
    full = full_forward(trainer, model, batch, masked)
    shared = shared_prefix.shared_prefix_logps(
        model, batch, masked, temperature=trainer.temperature, compute_entropy=True
    )
    assert shared[0].dtype == full[0].dtype == torch.bfloat16  # TRL keeps the logits' dtype
    mask = batch["completion_mask"].bool()
    for k, name in enumerate(("logps", "entropy")):
        diff = (shared[k].float() - full[k].float())[mask].abs().max().item()
        full_errors = (full[k].float() - reference[k])[mask].abs()
        shared_errors = (shared[k].float() - reference[k])[mask].abs()
        print(
            f"{setup['family']} bf16 {name}: max |shared - full| {diff:.4f}; vs fp32: mean {shared_errors.mean():.4f} "
            f"(full {full_errors.mean():.4f}), max {shared_errors.max():.4f} (full {full_errors.max():.4f})"
        )
        assert shared_errors.mean() <= BF16_ERROR_RATIO * full_errors.mean(), name
        assert shared_errors.max() <= BF16_ERROR_RATIO * full_errors.max(), name
        assert diff <= (BF16_LOGP_MAX_DIFF if name == "logps" else 2 * full_errors.max().item()), (name, diff)


@pytest.mark.model
@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_adapter_loss_unchanged(setup, estimator):
    """papo_loss_parts on a real rollout batch: parent loss bit for bit, every PAPO term within 1e-5."""
    model, processor = setup["model"], setup["processor"]
    dataset_trainer = setup["trainer"]
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    parts = {}
    for form in ("full", "shared_prefix"):
        trainer = tiny_trainer(
            model,
            processor,
            dataset_trainer.train_dataset,
            setup["work"] / f"{form}_{estimator}",
            num_generations=4,
            per_device_train_batch_size=12,
            masked_forward=form,
            entropy_estimator=estimator,
            perception_loss_weight=0.02,
            original_entropy_weight=0.03,
            masked_entropy_weight=0.03,
        )
        trainer.current_gradient_accumulation_steps = 1
        parent, terms = trainer.papo_loss_parts(model, batch)
        total = trainer.assemble_loss(parent, terms, 0.02, 0.03, 0.03)
        parts[form] = (parent.item(), terms.perception_kl.item(), terms.masked_entropy.item(), total.item())
        assert trainer._metrics["train"][shared_prefix.METRIC] == [float(form == "shared_prefix")]
    full, shared = parts["full"], parts["shared_prefix"]
    print(estimator, "full", full, "shared", shared)
    assert shared[0] == full[0]
    assert all(abs(a - b) <= FP32_TOL for a, b in zip(shared[1:], full[1:])), (shared, full)
    assert full[1] > 1e-4, "a perception KL of zero would not test the masked branch"


def make(setup, **overrides):
    return tiny_trainer(
        setup["model"],
        setup["processor"],
        setup["trainer"].train_dataset,
        setup["work"] / "fallback",
        num_generations=4,
        per_device_train_batch_size=12,
        **overrides,
    )


@pytest.mark.model
def test_auto_falls_back_with_its_reason_in_the_metrics(setup, caplog):
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    cases = [
        (dict(), 1.0, "masked_forward='auto'", batch),
        (dict(masked_forward="full"), 0.0, "masked_forward='full'", batch),
        (dict(masked_branch="update", masked_branch_grad=True), 0.0, "masked_branch_grad=True", batch),
        (dict(mask_sharing="completion"), 0.0, "mask_sharing='completion'", batch),
        (dict(), 0.0, "no prompt has two completions", select_rows(setup["batch"], [0, 4, 8])),
    ]
    for overrides, metric, reason, inputs in cases:
        trainer = make(setup, **overrides)
        trainer.current_gradient_accumulation_steps = 1
        with caplog.at_level("INFO", logger="papo_nb.papo.masked_branch"):
            caplog.clear()
            trainer.papo_loss_parts(setup["model"], inputs)
        assert trainer._metrics["train"][shared_prefix.METRIC] == [metric], overrides
        assert reason in caplog.text, (overrides, caplog.text)
        if metric:
            assert trainer._metrics["train"][shared_prefix.SHARE_METRIC] == [7 / 3]


@pytest.mark.model
def test_explicit_shared_prefix_runs_on_any_batch_and_per_completion_masks(setup):
    """Forced on, it is still exact where nothing is shared: every completion its own prompt or its own mask (in the
    loss call; at rollout time the combination is refused, ``test_trainer.py``)."""
    trainer = make(setup, masked_forward="shared_prefix", mask_sharing="completion", masked_branch="update")
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    trainer.masks.restart(seed=7)
    masked = trainer.masked_pixel_values(batch)
    assert len(shared_prefix.prompt_groups(batch, masked)) == 7, "per-completion masks: no two rows share an image"
    full = full_forward(trainer, setup["model"], batch, masked)
    shared = shared_prefix.shared_prefix_logps(setup["model"], batch, masked, temperature=1.0, compute_entropy=True)
    assert max(max_errors(shared, full, batch["completion_mask"])) <= FP32_TOL
    # through the branch, with the groups the masking hands over (every row alone) and the same masks replayed
    trainer.masks.restart(seed=7)
    with torch.no_grad():
        branch = trainer.masked_forward(setup["model"], batch)
    assert trainer._metrics["train"][shared_prefix.SHARE_METRIC] == [1.0]
    assert max(max_errors(branch[:1], full[:1], batch["completion_mask"])) <= FP32_TOL  # sampled: no entropies


@pytest.mark.model
def test_gradient_checkpointing_keeps_the_cache_under_no_grad(setup):
    model, trainer = setup["model"], setup["trainer"]
    batch = select_rows(setup["batch"], UNEQUAL_ROWS)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        model.train()
        full = full_forward(trainer, model, batch, batch["pixel_values"])
        shared = shared_prefix.shared_prefix_logps(
            model, batch, batch["pixel_values"], temperature=1.0, compute_entropy=True
        )
    finally:
        model.gradient_checkpointing_disable()
    assert max(max_errors(shared, full, batch["completion_mask"])) <= FP32_TOL


def test_refused_where_it_cannot_run(tmp_path):
    with pytest.raises(ValueError, match="masked_forward='shared_prefix' is invalid with masked_branch_grad=True"):
        PAPOGConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, masked_forward="shared_prefix", masked_branch_grad=True
        )
    with pytest.raises(ValueError, match=r"PAPOGConfig.masked_forward='prefix' is invalid: expected one of"):
        PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, masked_forward="prefix")
    # a real text-only model of another family
    from transformers import Qwen2Config, Qwen2ForCausalLM

    text_model = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    forced = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, masked_forward="shared_prefix")
    with pytest.raises(ValueError, match="model_type 'qwen2' is not one of"):
        shared_prefix.plan(forced, text_model)
    auto = PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    plan = shared_prefix.plan(auto, text_model)
    assert not plan.shared and "model_type 'qwen2'" in plan.reason


@pytest.mark.model
def test_paper_shapes_benchmark_reports_every_variant(tiny_vlm_path, tmp_path):
    """The issue-14 benchmark end to end on the tiny model: every variant timed, the two forms equal, and the shared
    masked branch's memory peak below the full one's."""
    from papo_nb.bench import paper_shapes

    setup = paper_shapes.cpu_setup(
        paper_shapes.Shape(112, 8, 2),
        family="qwen2_vl",
        seed=0,
        cache_dir=tiny_vlm_path.parent,
        work_dir=tmp_path,
        size="tiny",
    )
    result = paper_shapes.measure(setup, repeats=2, warmup=0, device=torch.device("cpu"), log=lambda _: None)
    result["shape"] = paper_shapes.shape_facts(setup)
    assert set(result["timings"]) == set(paper_shapes.VARIANTS) and result["clock"] == "cpu"
    assert all(t["median"] > 0 and t["n"] == 2 for t in result["timings"].values())
    assert (result["shape"]["group_size"], result["shape"]["sequences"]) == (8, 16)
    assert result["equivalence"]["masked_logp_max_abs_diff"] <= FP32_TOL
    assert result["equivalence"]["loss_abs_diff"] <= FP32_TOL
    assert result["peak_mib"]["masked_shared"] < result["peak_mib"]["masked_full"]
    table = paper_shapes.markdown({"tiny": result})
    assert table.count("\n") == 1 + len(paper_shapes.VARIANTS)
    assert "PAPO-G/GRPO full" in paper_shapes.summary_lines({"tiny": result})[0]


class VocabularyTensors(TorchDispatchMode):
    """The peak bytes of the live tensors whose last dimension is ``vocab`` (distinct storages, so a view counts
    once; the model's weights, such as the LM head's transpose, do not count), watched at every operation."""

    def __init__(self, vocab: int, model):
        super().__init__()
        self.vocab, self.tensors, self.peak = vocab, [], 0
        self.weights = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[-1] == self.vocab:
                self.tensors.append(weakref.ref(leaf))
        live = {
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in map(weakref.ref.__call__, self.tensors)
            if t is not None
        }
        self.peak = max(self.peak, sum(size for pointer, size in live.items() if pointer not in self.weights))
        return out


@pytest.mark.model
@pytest.mark.parametrize("compute_entropy", [False, True])
def test_masked_forward_keeps_one_full_vocabulary_copy_of_a_chunk(setup, compute_entropy):
    """At a vocabulary of 8192 (the tiny model's embeddings resized), the shared-prefix masked forward holds one
    chunk's completion logits (12 rows x C x V, fp32) and TRL's entropy temporaries of one completion, no more: no
    concatenated second copy (the first token's logit beside the others')."""
    vocab = 8192
    model = copy.deepcopy(setup["model"])
    shared_prefix.core_model(model).resize_token_embeddings(vocab)
    trainer, batch = setup["trainer"], setup["batch"]
    masked = trainer.masked_pixel_values(batch)
    rows, width = batch["completion_ids"].shape
    one_copy = rows * width * vocab * 4
    with torch.no_grad(), VocabularyTensors(vocab, model) as watch:
        shared_prefix.shared_prefix_logps(
            model, batch, masked, temperature=trainer.temperature, compute_entropy=compute_entropy, max_chunk_rows=rows
        )
    entropy_temporaries = 3 * width * vocab * 4 if compute_entropy else 0  # log-softmax, exp, product of one row
    print(f"entropy {compute_entropy}: peak {watch.peak / one_copy:.2f} x one chunk's logits ({one_copy} bytes)")
    assert one_copy * 0.9 <= watch.peak <= one_copy + entropy_temporaries
