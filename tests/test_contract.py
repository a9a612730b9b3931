"""The pinned constants, the live and static TRL contract checks, and upstream source verification."""

import functools
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import trl
from trl import GRPOTrainer

from papo_nb.papo import contract
from papo_nb.papo.probe import contract as probe_contract
from papo_nb.prefix_sharing import trl_seams
from papo_nb.workbook.verification import provenance


def test_constants_match_the_spec():
    assert contract.PAPO_ADAPTER_VERSION == "trl_0.29.1_papo_g_on_trl_1.9.1_v1"
    assert contract.PAPO_UPSTREAM_SOURCE_SHA256 == "9836f4505f7026c90cd5ca5b97151dd14c1bc27bcd2bc5a8fca6626c68279175"
    assert contract.PAPO_UPSTREAM_SOURCE_URL.endswith("/v0.29.1/trl/experimental/papo/papo_trainer.py")
    assert probe_contract.GAMMA_ZERO_GRADIENT_REL_TOL == 5e-2
    assert probe_contract.GAMMA_ZERO_GRADIENT_ABS_FLOOR == 1e-6
    assert contract.PAPO_PROBE_MAX_DEGENERATE_BATCHES == 20


def test_live_contract_holds_on_installed_trl():
    assert contract.supported_release(trl.__version__), trl.__version__
    contract.validate_trl_parent_contract(GRPOTrainer)


def test_the_supported_range_is_read_from_version_strings():
    assert contract.SUPPORTED_TRL == ("1.9.1", "1.16.0")
    versions = ("1.8.0", "1.9.1", "1.14.2", "1.16.0", "1.16.0.dev0", "1.17.0")
    assert [contract.supported_release(v) for v in versions] == [False, True, True, True, True, False]


def test_live_contract_names_a_drifted_signature():
    class Drifted(GRPOTrainer):
        def _compute_loss(self, model, inputs, extra):
            pass

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep):
            return self._entropy_bonus_enabled

    with pytest.raises(contract.ContractError) as info:
        contract.validate_trl_parent_contract(Drifted, "1.17.0")
    message = str(info.value)
    assert message.startswith("TRL 1.17.0 is not supported by the PAPO-G adapter")
    assert "Newest supported release: trl==1.16.0" in message
    assert "('self', 'model', 'inputs', 'extra')" in message
    for name in ("pixel_values", "image_grid_thw", "compute_aux_loss", "mm_token_type_ids"):
        assert f"has no parameter {name!r}" in message


def _installed_grpo_source() -> str:
    return (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text()


@functools.cache
def _release_source(version: str = "1.9.1") -> str:
    """``grpo_trainer.py`` of a TRL release, read from its wheel (pip download, cached): the mutation tests below edit
    1.9.1's text whichever TRL is installed."""
    return provenance.read_wheel_member(provenance.fetch_trl_wheel(version), contract.PARENT_GRPO_FILE).decode()


def test_static_check_reproduces_live_check_on_installed_release():
    assert (
        contract.static_contract_violations(_installed_grpo_source())
        == contract.live_contract_violations(GRPOTrainer)
        == []
    )


def test_static_check_rejects_drifted_source():
    source = _release_source()
    drifted = source.replace("        image_position_ids=None,\n    ) -> tuple", "    ) -> tuple", 1)
    assert drifted != source
    assert contract.static_contract_violations(drifted) == [
        "GRPOTrainer._get_per_token_logps_and_entropies has no parameter 'image_position_ids'"
    ]
    renamed = source.replace("def _compute_loss(self, model, inputs):", "def _compute_loss(self, model, batch):", 1)
    assert "signature changed" in contract.static_contract_violations(renamed)[0]
    no_gate = source.replace(
        "self._entropy_bonus_enabled:\n                    entropies", "True:\n                    entropies", 1
    )
    assert contract.static_contract_violations(no_gate) == [
        "GRPOTrainer._get_per_token_logps_and_entropies no longer reads self._entropy_bonus_enabled"
    ]
    assert contract.static_contract_violations("class Other: pass") == ["no class GRPOTrainer in the source"]


@pytest.fixture(scope="session")
def upstream_wheel(tmp_path_factory) -> Path:
    """The real trl==0.29.1 wheel, fetched with pip into a cache (PyPI is reachable here and in CI)."""
    return provenance.fetch_trl_wheel(contract.PAPO_UPSTREAM_TRL_VERSION)


def test_source_verification_matches_real_wheel(upstream_wheel):
    result = provenance.verify_upstream_source(upstream_wheel)
    assert result.match, result
    assert result.actual_sha256 == contract.PAPO_UPSTREAM_SOURCE_SHA256


def test_source_verification_reports_tampered_wheel(upstream_wheel, tmp_path):
    tampered = tmp_path / upstream_wheel.name
    with zipfile.ZipFile(upstream_wheel) as source, zipfile.ZipFile(tampered, "w") as target:
        for item in source.infolist():
            data = source.read(item)
            if item.filename == contract.PAPO_UPSTREAM_SOURCE_PATH:
                data += b"\n# tampered\n"
            target.writestr(item, data)
    result = provenance.verify_upstream_source(tampered)
    assert not result.match
    assert result.actual_sha256 not in (None, contract.PAPO_UPSTREAM_SOURCE_SHA256)
    missing = provenance.verify_upstream_source(tmp_path / "absent.whl")
    assert not missing.match and missing.actual_sha256 is None and missing.error


@pytest.mark.parametrize(
    ("status", "passed", "warned"),
    [("passed", True, False), ("underpowered", True, True), ("pending", False, False), ("failed", False, False)],
)
def test_verdict_warns_on_an_underpowered_probe_and_fails_an_unfinished_one(status, passed, warned):
    from papo_nb.papo.probe import ProbeEvidence

    source = provenance.SourceVerification("w.whl", "m", "a" * 64, "a" * 64, True)
    verdict = provenance.contract_verdict(source, [], [], ProbeEvidence(status, f"probe {status}"))
    assert verdict["passed"] is passed and verdict["probe_status"] == status
    assert bool(verdict["warnings"]) is warned and ("WARNING" in verdict["verdict"]) is warned
    assert verdict["probe_passed"] is (status == "passed")


def test_the_verdict_words_other_releases_as_information_not_as_a_warning():
    """Issue 61: "PASS ... releases drifted: 0.29.1" read as a warning; 0.29.1 is the ported source's release. The
    verdict says what the drift table is (information), counts the releases that hold, names the ones the adapter
    would refuse, and sets the upstream release apart."""
    from papo_nb.papo.probe import ProbeEvidence
    from papo_nb.workbook.verification.trl_releases import DriftRow

    source = provenance.SourceVerification("w.whl", "m", "a" * 64, "a" * 64, True)
    rows = [DriftRow("0.29.1", "drift", ["x"]), DriftRow("1.9.1", "ok", []), DriftRow("1.10.0", "ok", [])]
    verdict = provenance.contract_verdict(source, [], rows, ProbeEvidence("passed", "ok"))["verdict"]
    assert verdict.startswith("PASS: upstream SHA verified, live TRL contract holds, gamma-zero probe passed. ")
    assert "drifted" not in verdict and "WARNING" not in verdict
    assert "information, not part of the verdict): 2 of 3 hold the contract" in verdict
    assert "none the adapter would refuse" in verdict
    assert "0.29.1 is the ported upstream source, not a parent: it differs, as expected" in verdict
    rows.append(DriftRow("1.17.0", "drift", ["y"]))
    rows.append(DriftRow("1.18.0", "unavailable", ["offline"]))
    verdict = provenance.contract_verdict(source, [], rows, ProbeEvidence("passed", "ok"))["verdict"]
    assert "the adapter would refuse 1.17.0" in verdict and "not fetched: 1.18.0." in verdict


def test_static_check_names_a_drifted_generation_round():
    """What the rollout-time masked branch relies on: the method's signature, the keys it reads from the returned
    batch, and _prepare_inputs buffering that batch."""
    source = _release_source()
    renamed = source.replace(
        "def _generate_and_score_completions(\n        self, inputs:",
        "def _generate_and_score_completions(\n        self, batch:",
        1,
    )
    assert renamed != source
    assert contract.static_contract_violations(renamed) == [
        "GRPOTrainer._generate_and_score_completions signature changed: ('self', 'batch') != ('self', 'inputs')"
    ]
    no_key = source.replace('"completion_mask": completion_mask,\n            "advantages"', '"advantages"', 1)
    assert no_key != source
    assert contract.static_contract_violations(no_key) == [
        "GRPOTrainer._generate_and_score_completions no longer returns 'completion_mask'"
    ]
    unbuffered = source.replace("self._buffered_inputs = [", "buffered = [", 1).replace(
        "inputs = self._buffered_inputs[", "inputs = buffered[", 1
    )
    unbuffered = unbuffered.replace("or self._buffered_inputs is None", "", 1)
    assert contract.static_contract_violations(unbuffered) == [BUFFER_DRIFT]


BUFFER_DRIFT = (
    "GRPOTrainer._prepare_inputs no longer buffers the result of _generate_and_score_completions in "
    "self._buffered_inputs and serves it as self._buffered_inputs[self._step % self.args.steps_per_generation]"
)
ROUND_DRIFT = (
    "GRPOTrainer._prepare_inputs no longer starts a generation round when self._step % "
    "(self.args.steps_per_generation * self.num_iterations) == 0: the masks' generation_round would not be TRL's"
)


@pytest.mark.parametrize(
    ("original", "mutated", "expected"),
    [
        (  # a round that ignores num_iterations: masks drawn per round would change inside TRL's round
            "generate_every = self.args.steps_per_generation * self.num_iterations",
            "generate_every = self.args.steps_per_generation",
            ROUND_DRIFT,
        ),
        (  # a round started on another step
            "if self._step % generate_every == 0 or",
            "if self._step % generate_every == 1 or",
            ROUND_DRIFT,
        ),
        (  # served by another index: the stored masked branch would reach another device batch's loss call
            "inputs = self._buffered_inputs[self._step % self.args.steps_per_generation]",
            "inputs = self._buffered_inputs[0]",
            BUFFER_DRIFT,
        ),
        (  # the loss-call counter no longer advances once per call
            "        self._step += 1\n        time_after",
            "        self._step += 2\n        time_after",
            "GRPOTrainer.training_step no longer counts self._step += 1",
        ),
    ],
)
def test_static_check_pins_the_round_cadence_the_masks_share(original, mutated, expected):
    """``mask_state.generation_round`` is ``_step // (steps_per_generation * num_iterations)``: TRL's own cadence,
    pinned as it is written, and the buffer that serves a round's device batches; each mutation of them is named."""
    source = _release_source()
    drifted = source.replace(original, mutated, 1)
    assert drifted != source, original
    assert contract.static_contract_violations(drifted) == [expected]


def test_the_masks_round_is_the_pinned_cadence():
    """The trainer's round of a loss call is ``_step // ROUND_LENGTH``: a new one exactly where TRL regenerates."""
    from papo_nb.papo.mask_state import generation_round

    steps_per_generation, num_iterations = 3, 2
    starts = [step for step in range(24) if step % (steps_per_generation * num_iterations) == 0]
    rounds = [generation_round(step, steps_per_generation, num_iterations) for step in range(24)]
    assert [step for step in range(1, 24) if rounds[step] != rounds[step - 1]] == starts[1:]
    assert rounds[0] == 0 and rounds[-1] == 3


def test_grad_norm_hook_holds_and_names_its_drift():
    import transformers

    contract.validate_grad_norm_hook(transformers.Trainer)

    class Drifted(transformers.Trainer):
        def _get_grad_norm(self, model):
            return None

    with pytest.raises(contract.ContractError, match=r"_get_grad_norm signature changed: \('self', 'model'\)"):
        contract.validate_grad_norm_hook(Drifted)


def test_the_trainer_forwards_exactly_the_parents_parameters():
    """``PAPOGTrainer.__init__`` spells out the parent's parameters (names, order, defaults) and forwards them by
    name: a parameter TRL adds or renames shows here before it is silently dropped."""
    import inspect

    from trl import GRPOTrainer

    from papo_nb.papo import PAPOGTrainer
    from papo_nb.papo.papo_trainer import PARENT_PARAMETERS

    ours = list(inspect.signature(PAPOGTrainer.__init__).parameters.values())[1:]
    parents = list(inspect.signature(GRPOTrainer.__init__).parameters.values())[1:]
    assert [p.name for p in ours] == [p.name for p in parents] == list(PARENT_PARAMETERS)
    assert [p.default for p in ours] == [p.default for p in parents]


@pytest.mark.parametrize(
    ("original", "mutated", "method"),
    [
        (  # the loss call's kept logits no longer the completion width: packing would split its rows wrongly
            "logits_to_keep = completion_ids.size(1)  # we only need to compute the logits for the completion tokens\n"
            "        mask = completion_mask",
            "logits_to_keep = completion_ids.size(1) + 1\n        mask = completion_mask",
            "_compute_loss",
        ),
        (  # the rollout's rows no longer [prompt; completion]
            "prompt_completion_ids = torch.cat([prompt_ids, completion_ids], dim=1)",
            "prompt_completion_ids = torch.cat([completion_ids, prompt_ids], dim=1)",
            "_generate_and_score_completions",
        ),
        (  # the round shuffled by another function: the whole-group shuffle would not take its place
            "generation_batch = shuffle_sequence_dict(generation_batch)",
            "generation_batch = shuffle_rows(generation_batch)",
            "_prepare_inputs",
        ),
    ],
)
def test_static_check_pins_what_prefix_sharing_relies_on(original, mutated, method):
    source = _release_source()
    drifted = source.replace(original, mutated, 1)
    assert drifted != source, original
    problems = contract.static_contract_violations(drifted)
    assert len(problems) == 1 and problems[0].startswith(f"GRPOTrainer.{method} no longer runs `"), problems
    assert "(prefix sharing relies on it)" in problems[0]


# ---- the per-release seam (trl_seams.py), on the real wheels of the releases where the form changed ----
@pytest.mark.parametrize(
    ("version", "form"),
    [("1.9.1", trl_seams.LOGITS), ("1.10.0", trl_seams.LOGITS), ("1.14.2", trl_seams.VARIADIC),
     ("1.16.0", trl_seams.FUSED)],
)  # fmt: skip
def test_each_release_form_is_told_apart_by_what_its_method_does(version, form):
    source = _release_source(version)
    assert trl_seams.seam_of(contract.source_methods(source)) is form
    assert contract.static_contract_violations(source) == []
    assert form.packed_paths, "prefix sharing reproduces every form (prefix_sharing/packed_head.py)"
    assert form.prefill_path is (form is trl_seams.LOGITS)


def test_the_installed_form_decides_whether_the_shared_prefix_runs():
    assert trl_seams.packed_path_reason(GRPOTrainer) is None
    reason = trl_seams.prefill_reason(GRPOTrainer)
    form = trl_seams.live_seam(GRPOTrainer)
    assert (reason is None) is (form is trl_seams.LOGITS)
    if reason is not None:
        assert trl.__version__ in reason and repr(form.name) in reason
    assert trl_seams.signature_method(GRPOTrainer).__name__ == form.signature_method


@pytest.mark.parametrize(
    ("version", "original", "mutated", "expected"),
    [
        (  # 1.10's out-of-place division is accepted; a temperature applied otherwise is named
            "1.10.0",
            "logits = logits / self.temperature",
            "logits = logits * self.temperature",
            "GRPOTrainer._get_per_token_logps_and_entropies no longer divides its logits by self.temperature as "
            "`logits.div_(self.temperature)` or `logits = logits / self.temperature` (prefix sharing relies on it)",
        ),
        (  # 1.14: the delegate must still give entropies their gradient when the adapter asks for it
            "1.14.2",
            "entropy_requires_grad=self._entropy_bonus_enabled",
            "entropy_requires_grad=False",
            "GRPOTrainer._full_logits_logps no longer reads self._entropy_bonus_enabled",
        ),
        (  # 1.14: the delegate that names the arguments is gone
            "1.14.2",
            "def _full_logits_logps(",
            "def _full_logits(",
            "GRPOTrainer has no method _full_logits_logps for _get_per_token_logps_and_entropies(*args, **kwargs) "
            "to reach",
        ),
        (  # 1.15+: a fused head patched without entropies
            "1.16.0",
            'outputs=("log_probs", "entropy"),',
            'outputs=("log_probs",),',
            "GRPOTrainer.__init__ no longer patches the policy with add_fused_lm_head(..., outputs=('log_probs', "
            "'entropy')): the masked branch's entropies would not exist",
        ),
        (  # 1.15+: entropies no longer read from the fused head's output
            "1.16.0",
            "all_entropies.append(outputs.entropy[:, -logits_to_keep:])",
            "all_entropies.append(outputs.log_probs[:, -logits_to_keep:])",
            "GRPOTrainer._get_per_token_logps_and_entropies no longer reads outputs.entropy from the fused head",
        ),
        (  # 1.15+: prefix sharing runs there (through the fused head), so its round shuffle is that form's fact too
            "1.16.0",
            "generation_batch = shuffle_sequence_dict(generation_batch)",
            "generation_batch = shuffle_rows(generation_batch)",
            "GRPOTrainer._prepare_inputs no longer runs `generation_batch = shuffle_sequence_dict(generation_batch)` "
            "(prefix sharing relies on it)",
        ),
    ],
)
def test_each_forms_facts_are_pinned_and_named(version, original, mutated, expected):
    source = _release_source(version)
    drifted = source.replace(original, mutated, 1)
    assert drifted != source, original
    assert contract.static_contract_violations(drifted) == ([expected] if expected else [])


@pytest.mark.slow
def test_a_rejected_release_fails_at_trainer_construction_naming_release_fact_and_newest(tmp_path):
    """TRL 1.7.1 (its wheel unpacked in front of the installed TRL, in a fresh interpreter): constructing the trainer
    stops before any model loads, with the release, the broken fact and the newest supported release."""
    with zipfile.ZipFile(provenance.fetch_trl_wheel("1.7.1")) as wheel:
        wheel.extractall(tmp_path / "site")  # its dist-info too: trl.__version__ is read from the metadata
    script = (
        "from papo_nb.papo import PAPOGConfig, PAPOGTrainer\n"
        f"args = PAPOGConfig(output_dir={str(tmp_path / 'out')!r}, bf16=False, use_cpu=True)\n"
        "PAPOGTrainer(model='tiny:qwen2_vl', args=args)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 1
    assert "ContractError: TRL 1.7.1 is not supported by the PAPO-G adapter" in result.stderr, result.stderr[-2000:]
    last = result.stderr[result.stderr.index("ContractError: TRL 1.7.1") :]
    assert "GRPOTrainer._get_per_token_logps_and_entropies no longer reads self._entropy_bonus_enabled" in last
    assert "Newest supported release: trl==1.16.0" in last
