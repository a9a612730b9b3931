"""Prefix sharing on each TRL release's own log-prob form (``packed_head.py``): on 1.15+ the packed row's
needed positions go through the fused LM head ``GRPOTrainer.__init__`` installed (TRL's tiled kernel on exactly those
hidden states, never the ``lm_head`` module, so no vocabulary-sized logits); on 1.14 through ``_full_logits_logps``'s
``selective_log_softmax(..., temperature=)``; on 1.9.1-1.13 through the model's logits at the needed positions, divided
by the temperature. Each is exact against that release's plain forward (log-probs, entropies with their graph and
every parameter's gradient, fp64 and fp32, the adversarial batch of ``test_prefix_sharing.py``), and each test asserts
the form it runs on (1.9.1 in ``.venv``, 1.16.0 in the newest-TRL tier of ``.ci/run``). The fused head's facts the
packed path relies on are pinned (``trl_seams.FUSED_HEAD_STATEMENTS``); a policy without TRL's head runs the plain
forward with its reason; the shared prompt prefix (``prefill.py``) keeps the release's reason on 1.14+."""

import ast
import copy

import pytest
import test_prefix_sharing_checkpointing as checkpointing_tests
import torch
from test_prefix_sharing import (
    FORCED_FORMS,
    TOLERANCE,
    completion_mask,
    gradients,
    in_dtype,
    max_error,
    worst_relative_error,
)
from trl import GRPOTrainer
from trl.trainer import utils as trl_utils

from papo_nb.papo import prefill
from papo_nb.prefix_sharing import grouped_attention, packed_head, trl_seams
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.workbook.verification import provenance

setup = checkpointing_tests.setup  # the tiny Qwen2.5-VL, its trainer (prefix_sharing=True) and the adversarial batch
as_the_release_runs = checkpointing_tests.as_the_release_runs
FORM = trl_seams.live_seam(GRPOTrainer)


class HeadCalls:
    """What scored the vocabulary during a call: the ``lm_head`` module's outputs (shapes) and the hidden states TRL's
    fused kernel received (shapes), through a forward hook and a subclass that calls TRL's own function."""

    def __init__(self, model, monkeypatch):
        self.lm_head, self.fused = [], []
        model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: self.lm_head.append(out.shape))
        kernel = getattr(trl_utils, "_ChunkedLogProbFunction", None)
        if kernel is not None:
            calls = self.fused

            class Recorded(kernel):
                @staticmethod
                def forward(ctx, hidden_states, *args):
                    calls.append(tuple(hidden_states.shape))
                    return kernel.forward(ctx, hidden_states, *args)

            monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Recorded)

    def clear(self):
        self.lm_head.clear()
        self.fused.clear()


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("form", sorted(FORCED_FORMS))
def test_the_packed_forward_scores_through_the_releases_own_head(setup, monkeypatch, dtype, form):
    monkeypatch.setattr(grouped_attention, "grouped_forms", lambda *_: FORCED_FORMS[form])
    model = as_the_release_runs(copy.deepcopy(setup["model"]).to(dtype))
    arguments = in_dtype(setup["arguments"], dtype)
    (batch,) = prefix_sharing.packed_batches(model, arguments)
    needed = len(batch.targets)
    heads = HeadCalls(model, monkeypatch)
    trainer = setup["trainer"]
    reference, (plain_logps, plain_entropies) = gradients(trainer, model, arguments, "plain")
    plain_heads = (list(heads.lm_head), list(heads.fused))
    heads.clear()
    ours, (logps, entropies) = gradients(trainer, model, arguments, "hook")
    mode = "train" if trainer.model.training else "eval"
    assert trainer._metrics[mode][prefix_sharing.METRIC][-1] == 1.0, "packed on every release"
    hidden = model.config.text_config.hidden_size
    if FORM is trl_seams.FUSED:  # TRL's kernel on the needed positions only (repeats included), never the lm_head
        assert plain_heads[0] == [] and heads.lm_head == [], "no vocabulary-sized logits on the fused form"
        assert heads.fused == [(needed, hidden)], heads.fused
    else:  # the logits forms: the lm_head on the needed positions of the packed row, once
        assert heads.fused == [] and heads.lm_head == [torch.Size([1, needed, model.config.text_config.vocab_size])]
    mask = completion_mask(arguments)
    errors = (max_error(logps, plain_logps, mask), max_error(entropies, plain_entropies, mask))
    worst = worst_relative_error(reference, ours)
    print(f"TRL form {FORM.name}, {dtype} {form}: logps {errors[0]:.2e} entropies {errors[1]:.2e} grads {worst:.2e}")
    assert max(errors) <= TOLERANCE[dtype][0] and worst <= TOLERANCE[dtype][1]


@pytest.mark.model
def test_a_policy_without_trls_fused_head_runs_the_plain_forward_and_says_why(setup):
    sharing = setup["trainer"].prefix_sharing
    bare = copy.deepcopy(setup["model"])  # as loaded: GRPOTrainer.__init__ has not patched it
    reason = sharing.reason_now(bare)
    if FORM is trl_seams.FUSED:
        assert reason == packed_head.release_reason(bare)
        assert f"has no {trl_seams.FUSED_KEYWORD}= / {trl_seams.FUSED_UNSHIFTED_LABELS}=" in reason, reason
        assert sharing.reason_now(as_the_release_runs(bare)) is None
    else:  # the logits forms score the model's own logits: any policy
        assert reason is None and packed_head.release_reason(bare) is None


def _fused_head_source() -> ast.FunctionDef:
    """``add_fused_lm_head`` of TRL 1.16.0, parsed from its wheel (whichever TRL is installed)."""
    source = provenance.read_wheel_member(provenance.fetch_trl_wheel("1.16.0"), "trl/trainer/utils.py").decode()
    (patch,) = [
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "add_fused_lm_head"
    ]
    return patch


def test_the_fused_heads_facts_are_pinned_and_a_change_is_named():
    patch = _fused_head_source()
    assert trl_seams.fused_head_violations(patch) == []
    if FORM is trl_seams.FUSED:
        assert trl_seams.installed_fused_head_violations(GRPOTrainer) == ()
    shifted = ast.parse(ast.unparse(patch).replace("labels = shift_labels\n", "labels = shift_labels[:, 1:]\n"))
    assert trl_seams.fused_head_violations(shifted.body[0]) == [
        "add_fused_lm_head no longer runs `labels = shift_labels` (prefix sharing relies on it)"
    ]
    renamed = ast.parse(ast.unparse(patch).replace("shift_labels=None", "pre_shifted_labels=None"))
    assert "add_fused_lm_head's patched forward no longer takes shift_labels=" in (
        trl_seams.fused_head_violations(renamed.body[0])
    )
    assert trl_seams.fused_head_violations(None) == [
        "TRL has no add_fused_lm_head where GRPOTrainer's module imports it"
    ]


@pytest.mark.model
def test_the_shared_prefix_keeps_the_releases_reason(setup):
    """The no-grad masked branch's shared prompt prefix builds logits as 1.9.1 does: it runs on the logits form only,
    and on 1.14+ the plan names the release's reason."""
    args = copy.copy(setup["trainer"].args)
    args.masked_forward, args.masked_branch_grad, args.mask_sharing = "auto", False, "prompt"
    decided = prefill.plan(args, as_the_release_runs(copy.deepcopy(setup["model"])))
    if FORM is trl_seams.LOGITS:
        assert trl_seams.prefill_reason() is None and decided.shared, decided
    else:
        assert trl_seams.prefill_reason() is not None and not decided.shared
        assert trl_seams.prefill_reason() in decided.reason and repr(FORM.name) in decided.reason
    assert trl_seams.packed_path_reason() is None, "prefix sharing itself runs on every form"
