"""The grouped attention through FlexAttention's block mask (``prefix_sharing/flex_grouped.py``,
``PAPOGConfig.grouped_attention_kernel``), on the CPU: exact against the SDPA form (and TRL's plain forward) in
log-probs and entropies, fp32 compiled with ``torch.compile`` and fp64 eager (torch 2.14.1's inductor lowers flex on
the CPU in fp32/fp16/bf16 only), on the adversarial batch of ``test_prefix_sharing.py``; a wrong block mask fails by
far. torch has no FlexAttention backward on the CPU, so a gradient forward asked for flex runs the SDPA calls with
one warning, and its gradients are the SDPA form's; flex's own gradients are compared on CUDA by
``benchmarks/gpu_check.py --flex-only``. ``"auto"`` takes flex on CUDA only, and the forward plan names what runs."""

import collections
import copy
import logging

import pytest
import torch
from test_prefix_sharing import (
    TEMPERATURE,
    TOLERANCE,
    completion_mask,
    gradients,
    in_dtype,
    max_error,
    plain,
    setup,  # noqa: F401 - the module-scoped fixture of the tiny model and the adversarial batch
    worst_relative_error,
)
from tiny_trainers import tiny_trainer

from papo_nb.papo import PAPOGConfig
from papo_nb.prefix_sharing import flex_grouped, grouped_attention
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.testbed.models import load_vlm

LOGGER = "papo_nb.prefix_sharing.flex_grouped"
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def packed_with(model, arguments, kernel: str, entropy_grad=False):
    """``(logps, entropies, kernels run)`` of the packed path with ``grouped_attention_kernel=kernel``."""
    batches = list(prefix_sharing.packed_batches(model, arguments))
    for batch in batches:
        batch.layout.kernel_request = kernel
    logps, entropies, _, _ = prefix_sharing.packed_logps_and_entropies(
        model, arguments, temperature=TEMPERATURE, entropy_grad=entropy_grad, batches=batches
    )
    return logps, entropies, {batch.layout.kernel for batch in batches}


def test_auto_takes_flex_on_cuda_only_and_sdpa_is_selectable():
    assert flex_grouped.unavailable_reason() is None, "torch 2.14.1 has flex_attention"
    assert flex_grouped.choose("auto", CUDA, grad=True, dropout=0.0, head_dim=64) == flex_grouped.FLEX
    assert flex_grouped.choose("auto", CPU, grad=False, dropout=0.0, head_dim=64) == flex_grouped.SDPA
    assert flex_grouped.choose("sdpa", CUDA, grad=True, dropout=0.0, head_dim=64) == flex_grouped.SDPA
    assert flex_grouped.choose("flex", CPU, grad=False, dropout=0.0, head_dim=64) == flex_grouped.FLEX
    assert (
        flex_grouped.choose("flex", CPU, grad=True, dropout=0.0, head_dim=64) == flex_grouped.SDPA
    )  # no CPU backward
    assert (
        flex_grouped.choose("flex", CUDA, grad=True, dropout=0.1, head_dim=64) == flex_grouped.SDPA
    )  # flex has no dropout
    assert flex_grouped.choose("auto", CUDA, grad=True, dropout=0.0, head_dim=8) == flex_grouped.SDPA  # under 16
    assert flex_grouped.compiled_here(CPU, torch.float32) and not flex_grouped.compiled_here(CPU, torch.float64)
    with pytest.raises(ValueError, match=r"grouped_attention_kernel='triton' is invalid; allowed: one of"):
        flex_grouped.choose("triton", CUDA, grad=True, dropout=0.0, head_dim=64)


def test_the_config_refuses_an_unknown_kernel(tmp_path):
    with pytest.raises(ValueError, match=r"grouped_attention_kernel.*'triton'.*one of \('auto', 'sdpa', 'flex'\)"):
        PAPOGConfig(output_dir=str(tmp_path), use_cpu=True, grouped_attention_kernel="triton")
    assert PAPOGConfig(output_dir=str(tmp_path), use_cpu=True).grouped_attention_kernel == "auto"


def test_the_cpu_limits_the_choice_rests_on_are_torchs():
    """The reasons ``flex_grouped`` gives are what this torch does: no backward on the CPU (so gradient forwards run
    SDPA), and no fp64 in the compiled CPU kernel (so fp64 runs eagerly); a torch that lifts either fails here."""
    from torch.nn.attention.flex_attention import flex_attention

    query = torch.randn(1, 2, 16, 8, requires_grad=True)
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(query, query, query)
    wide = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    with pytest.raises(Exception, match="supported in FlexAttention for CPU device"):
        torch.compile(flex_attention)(wide, wide, wide)


def test_one_flex_call_equals_the_batched_sdpa_calls_with_grouped_query_heads():
    """Attention alone on a flat row of three groups (a prompt without completions, completions of unequal length,
    128-position blocks crossed): flex's block mask and the stacked/split calls give the same outputs."""
    sizes = [(70, []), (9, [1, 40, 3]), (150, [30, 2])]  # (prompt, completions) per group
    token_groups = torch.cat([torch.full((p + sum(c),), g) for g, (p, c) in enumerate(sizes)])
    segments = torch.cat([torch.repeat_interleave(torch.arange(len(c) + 1), torch.tensor([p, *c])) for p, c in sizes])
    generator = torch.Generator().manual_seed(0)
    for dtype, tolerance in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        query = torch.randn(1, 4, len(segments), 16, generator=generator, dtype=dtype)
        key, value = (torch.randn(1, 2, len(segments), 16, generator=generator, dtype=dtype) for _ in range(2))
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = 2, True
        outputs = {}
        for kernel in (flex_grouped.SDPA, flex_grouped.FLEX):
            layout = grouped_attention.build_layout(token_groups, segments)
            layout.kernel = kernel
            outputs[kernel] = grouped_attention.grouped_attention_forward(
                module, query, key, value, layout, scaling=0.25
            )[0]
        error = (outputs["flex"] - outputs["sdpa"]).abs().max().item()
        print(f"{dtype}: one flex call against the SDPA calls, max abs error {error:.2e}")
        assert outputs["flex"].shape == (1, len(segments), 4, 16) and error <= tolerance


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64-eager", "fp32-compiled"])
def test_flex_logps_and_entropies_equal_the_sdpa_form_and_the_plain_forward(setup, dtype):  # noqa: F811
    tolerance = TOLERANCE[dtype][0]
    model = copy.deepcopy(setup["model"]).to(dtype)
    arguments = in_dtype(setup["arguments"], dtype)
    mask = completion_mask(arguments)
    with torch.no_grad():
        *flex, ran = packed_with(model, arguments, "flex")
        *sdpa, sdpa_ran = packed_with(model, arguments, "sdpa")
        reference = plain(setup["trainer"], model, arguments)
    assert ran == {flex_grouped.FLEX} and sdpa_ran == {flex_grouped.SDPA}
    against_sdpa = [max_error(a, b, mask) for a, b in zip(flex, sdpa)]
    against_plain = [max_error(a, b, mask) for a, b in zip(flex, reference)]
    compiled = "compiled" if flex_grouped.compiled_here(CPU, dtype) else "eager"
    print(
        f"{setup['family']} {dtype} flex ({compiled}): against SDPA logps {against_sdpa[0]:.2e} entropies "
        f"{against_sdpa[1]:.2e}; against the plain forward {against_plain[0]:.2e} {against_plain[1]:.2e}"
    )
    assert max(against_sdpa + against_plain) <= tolerance
    assert (flex[0][~mask] == 0).all()


@pytest.mark.model
def test_a_wrong_block_mask_fails_by_far(setup, monkeypatch):  # noqa: F811
    """The exactness test can fail: a block mask that lets each completion see its group's other completions moves
    the log-probs far beyond fp32's tolerance."""
    model = copy.deepcopy(setup["model"]).to(torch.float64)
    arguments = in_dtype(setup["arguments"], torch.float64)
    own_block_mask = flex_grouped.block_mask
    monkeypatch.setattr(
        flex_grouped, "block_mask", lambda groups, segments: own_block_mask(groups, segments.clamp(0, 1))
    )
    with torch.no_grad():
        leaked, _, ran = packed_with(model, arguments, "flex")
        reference = plain(setup["trainer"], model, arguments)[0]
    assert ran == {flex_grouped.FLEX}
    error = max_error(leaked, reference, completion_mask(arguments))
    print(f"{setup['family']} completions leaking into each other: logps {error:.2e}")
    assert error > 100 * TOLERANCE[torch.float32][0]


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_a_gradient_forward_asked_for_flex_on_the_cpu_runs_sdpa_with_its_reason(setup, dtype, caplog):  # noqa: F811
    model = copy.deepcopy(setup["model"]).to(dtype)
    arguments = in_dtype(setup["arguments"], dtype)
    reference, _ = gradients(setup["trainer"], model, arguments, "plain")
    model.zero_grad(set_to_none=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        flex_grouped._logged.clear()
        logps, entropies, ran = packed_with(model, arguments, "flex", entropy_grad=True)
    assert ran == {flex_grouped.SDPA}
    assert "the SDPA calls run in place of FlexAttention, because torch" in caplog.text
    assert "has no FlexAttention backward on the CPU" in caplog.text
    weights = torch.randn(logps.shape, generator=torch.Generator().manual_seed(2), dtype=logps.dtype)
    mask = completion_mask(arguments).to(dtype)
    ((logps * weights + 0.1 * entropies) * mask).sum().backward()
    ours = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    worst = worst_relative_error(reference, ours)
    print(f"{setup['family']} {dtype}: flex asked, SDPA ran in the gradient forward: worst relative error {worst:.2e}")
    assert worst <= TOLERANCE[dtype][1]


@pytest.mark.model
def test_the_forward_plan_names_the_kernel(tiny_vlm_path, shapes_dataset, tmp_path):
    names = {}
    for kernel in ("auto", "flex", "sdpa"):
        model, processor = load_vlm(str(tiny_vlm_path))
        trainer = tiny_trainer(
            model, processor, shapes_dataset, tmp_path / kernel, num_generations=3, per_device_train_batch_size=9,
            prefix_sharing=True, grouped_attention_kernel=kernel,
        )  # fmt: skip
        assert trainer.prefix_sharing.kernel == kernel
        names[kernel] = trainer.forward_plan.log_prob_reason
    assert "grouped attention through 'sdpa'," in names["auto"] and "FlexAttention" not in names["auto"]
    assert names["sdpa"] == names["auto"]
    assert (
        "grouped attention through FlexAttention's block mask in no-grad forwards, 'sdpa' in gradient "
        in (names["flex"])
    )
    assert (
        flex_grouped.description("auto", CUDA, "sdpa", 64)
        == "FlexAttention's block mask (grouped_attention_kernel='auto')"
    )


@pytest.mark.model
def test_the_trainers_sharing_runs_the_kernel_its_config_names(setup, monkeypatch):  # noqa: F811
    """From the config to the layers: ``PrefixSharing`` built from ``grouped_attention_kernel='flex'`` runs one flex
    call per text layer in a no-grad call (the old and reference log-probs), with the SDPA form's numbers."""
    model, arguments, trainer = setup["model"], setup["arguments"], setup["trainer"]
    flex_calls = []
    own_attention = flex_grouped.attention
    monkeypatch.setattr(flex_grouped, "attention", lambda *a: flex_calls.append(1) or own_attention(*a))
    results = {}
    for kernel in ("flex", "sdpa"):
        args = copy.copy(trainer.args)
        args.grouped_attention_kernel = kernel
        sharing = prefix_sharing.PrefixSharing(args, model, 1, {"eval": collections.defaultdict(list)})
        with torch.no_grad():
            results[kernel] = sharing.compute(model, arguments, temperature=TEMPERATURE, entropy_grad=False,
                                              training=False)  # fmt: skip
        results[f"{kernel} calls"] = len(flex_calls)
    layers = grouped_attention.text_config(model).num_hidden_layers
    assert results["flex calls"] == layers and results["sdpa calls"] == layers  # sdpa: none added
    errors = [max_error(a, b, completion_mask(arguments)) for a, b in zip(results["flex"][:2], results["sdpa"][:2])]
    assert max(errors) <= TOLERANCE[torch.float32][0], errors
