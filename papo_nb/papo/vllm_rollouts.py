"""vLLM rollouts: prompts vLLM expands exactly once, the rollout-fidelity guard, and the weight sync on vLLM's CPU
platform. Imports vLLM only on the vLLM path, lazily.

Single expansion. TRL hands vLLM the processor's prompt ids, whose image placeholders are already expanded (one
``<|image_pad|>`` per merged patch), together with the raw images as ``multi_modal_data`` (TRL 1.9.1
``trl/generation/vllm_generation.py:659-667`` colocate, ``trl/scripts/vllm_serve.py:600-603`` server; TRL 1.16.0
``vllm_generation.py:706-716`` colocate). vLLM's multimodal processor expands the placeholders a second time (16
become 31 for a 16-patch image), so the completion is sampled from a context the trainer never trains on
(huggingface/trl#6294). ``SingleExpansion`` collapses each run of image tokens to the one token the chat template
writes, and vLLM expands it once. TRL 1.16's server mode sends features processed apart and placed at the trainer's
own runs (``VLLMGeneration._place_features``, ``vllm_generation.py:519-548``): those prompts go through unchanged.

The guard (``RolloutFidelityGuard``): on the first vLLM round and every ``vllm_fidelity_every`` rounds, the prompt ids
vLLM generated from (``RequestOutput.prompt_token_ids``, returned by ``VLLMGeneration.generate``) must equal the
trainer's, and the mean |vLLM sampling log-prob - trainer log-prob| over completion tokens, on the same weights (TRL's
``old_per_token_logps``, computed anyway under its importance-sampling correction, ``grpo_trainer.py:2640-2655`` in
1.16.0), must stay within ``vllm_fidelity_logprob_tolerance``. A mismatch raises before the round's first optimizer
step. Cost: one comparison of token lists and one masked mean per checked round, no extra forward (with the
correction off, TRL computes no trainer log-probs and the guard checks the prompts only).

The CPU weight sync (``cpu_weight_sync``), only where vLLM's platform is the CPU: the CPU backend repacks each linear
weight after loading and leaves ``layer.weight`` empty (vLLM 0.31 ``model_executor/layers/linear.py``,
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``), so TRL's ``load_weights([(name, param)])``
(``vllm_generation.py:504-506``) fails; ``model_runner.reload_weights`` re-packs (vLLM 0.31
``v1/worker/gpu_model_runner.py:5492``). TRL 1.16's server client transfers weights over NCCL only
(``vllm_client.py:755-757``); on the CPU the weights go through a file and the dev-mode ``/collective_rpc``
``reload_weights``. Both then reset the prefix cache and the encoder cache (cached vision embeddings of old weights).
Everywhere else TRL's own sync runs.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from pathlib import Path

import torch

LIKELY_PROMPT_CAUSE = (
    "vLLM expanded image placeholders the processor had already expanded (huggingface/trl#6294; the adapter's "
    "SingleExpansion collapses them), or vLLM's processor resizes the images differently from the trainer's "
    "(min_pixels / max_pixels)"
)
LIKELY_LOGP_CAUSE = (
    "the weights vLLM samples from are not the trainer's (a failed weight sync), or vLLM samples with settings the "
    "trainer's log-probs do not apply (temperature, top_p/top_k, logit_bias / bad_words)"
)


class RolloutFidelityError(RuntimeError):
    """vLLM's rollouts do not come from the trainer's prompts or distribution: the run stops before it trains."""


def on_cpu_platform() -> bool:
    """vLLM's platform is the CPU (vLLM imported here, lazily: only the vLLM path calls this)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def collapse_image_runs(ids: list[int], image_token_id: int) -> list[int]:
    """``ids`` with each run of ``image_token_id`` shortened to one token (the chat template's placeholder)."""
    return [t for i, t in enumerate(ids) if t != image_token_id or i == 0 or ids[i - 1] != image_token_id]


class SingleExpansion:
    """Wraps ``VLLMGeneration.generate``: rows with images reach vLLM with one placeholder per image, and the prompt
    ids vLLM returns are kept for the guard beside the trainer's."""

    def __init__(self, generation, image_token_id: int | None, collapse: bool):
        self.generate = generation.generate
        self.image_token_id = image_token_id
        self.collapse = collapse and image_token_id is not None
        self.last = None  # (trainer's prompt ids, vLLM's prompt ids) of the latest call

    def __call__(self, prompts, images, num_generations, profiler=None):
        sent = prompts
        if self.collapse and images is not None:
            sent = [p if im is None else collapse_image_runs(p, self.image_token_id) for p, im in zip(prompts, images)]
        result = self.generate(prompts=sent, images=images, num_generations=num_generations, profiler=profiler)
        self.last = ([list(p) for p in prompts], [list(p) for p in result[0]])
        return result


def install(trainer) -> SingleExpansion | None:
    """Put ``SingleExpansion`` (and on vLLM's CPU platform the CPU weight sync) on ``trainer.vllm_generation``."""
    generation = getattr(trainer, "vllm_generation", None)
    if not trainer.args.use_vllm or generation is None:
        return None
    image_token_id = getattr(trainer.processing_class, "image_token_id", None)
    wrapper = SingleExpansion(generation, image_token_id, collapse=vllm_expands_placeholders(generation))
    generation.generate = wrapper
    if on_cpu_platform():
        generation.sync_weights = functools.partial(cpu_weight_sync, generation)
    return wrapper


def vllm_expands_placeholders(generation) -> bool:
    """vLLM expands the image placeholders of what ``generation`` sends: colocate mode in both TRL releases and TRL
    1.9.1's server (raw images beside the token ids); not TRL 1.16's server, whose features are placed at the
    trainer's own runs (``_place_features``)."""
    return generation.mode == "colocate" or not hasattr(generation, "_place_features")


@contextlib.contextmanager
def cpu_server_client(args):
    """Around the parent's constructor: on vLLM's CPU platform in server mode, TRL 1.16's ``init_communicator``
    (NCCL, CUDA only) is skipped; ``cpu_weight_sync`` needs no communicator."""
    if not (args.use_vllm and args.vllm_mode == "server") or not on_cpu_platform():
        yield
        return
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator
    VLLMClient.init_communicator = lambda self, *a, **k: None
    try:
        yield
    finally:
        VLLMClient.init_communicator = original


def cpu_weight_sync(generation) -> None:
    """The trainer's weights into vLLM on its CPU platform (colocate: in place; server: through a file)."""
    if generation.mode == "colocate":
        llm = generation.llm
        runner = llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=generation._iter_named_params())
        llm.reset_prefix_cache()
        llm.llm_engine.reset_encoder_cache()
        return
    client = generation.vllm_client
    with tempfile.TemporaryDirectory(prefix="papo_nb_vllm_weights_") as folder:
        # cloned: the iterator unmerges the LoRA weights in place once it is exhausted (TRL _iter_named_params)
        weights = {name: param.detach().clone() for name, param in generation._iter_named_params()}
        torch.save(weights, Path(folder) / "pytorch_model.bin")
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": folder}}
        for path, body in (("collective_rpc", rpc), ("reset_prefix_cache", None), ("reset_encoder_cache", None)):
            response = client.session.post(f"{client.base_url}/{path}", json=body, timeout=600)
            if response.status_code != 200:
                raise RuntimeError(f"vLLM server {path}: {response.status_code} {response.text[:500]}")


class RolloutFidelityGuard:
    """Checks a vLLM round (first, then every ``every`` rounds) against the trainer: see the module docstring."""

    def __init__(self, every: int, tolerance: float, metrics: dict):
        self.every, self.tolerance, self.metrics = every, tolerance, metrics
        self.rounds = 0

    def check(self, batch: dict, expansion: SingleExpansion | None) -> None:
        if expansion is None or expansion.last is None:
            return
        round_, self.rounds = self.rounds, self.rounds + 1
        if round_ != 0 and (self.every <= 0 or round_ % self.every):
            return
        problems = prompt_problems(*expansion.last, expansion.image_token_id)
        gap = logprob_gap(batch)
        self.metrics["papo/vllm_prompt_mismatch_rows"].append(float(len(problems)))
        if gap is not None:
            self.metrics["papo/vllm_logprob_gap"].append(gap)
        message = []
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            message.append(f"{len(problems)} row(s) generated from a different prompt: {shown}. Likely cause: "
                           f"{LIKELY_PROMPT_CAUSE}")  # fmt: skip
        if gap is not None and gap > self.tolerance:
            message.append(f"mean |vLLM sampling log-prob - trainer log-prob| = {gap:.4g} over completion tokens, "
                           f"above vllm_fidelity_logprob_tolerance = {self.tolerance:g}. Likely cause: "
                           f"{LIKELY_LOGP_CAUSE}")  # fmt: skip
        if message:
            raise RolloutFidelityError(f"rollout-fidelity guard, vLLM round {round_}: " + " | ".join(message))


def prompt_problems(trainer_ids: list, vllm_ids: list, image_token_id: int | None) -> list[str]:
    """One line per row whose vLLM prompt differs from the trainer's, with the lengths and image-token counts."""
    problems = []
    for row, (ours, theirs) in enumerate(zip(trainer_ids, vllm_ids, strict=True)):
        if ours != theirs:
            count = (lambda ids: sum(t == image_token_id for t in ids)) if image_token_id is not None else len
            problems.append(f"row {row}: vLLM {len(theirs)} tokens ({count(theirs)} image tokens), trainer "
                            f"{len(ours)} ({count(ours)})")  # fmt: skip
    return problems


def logprob_gap(batch: dict) -> float | None:
    """Mean |sampling - trainer| log-prob over the round's completion tokens, None without both."""
    sampling, trainer = batch.get("sampling_per_token_logps"), batch.get("old_per_token_logps")
    if sampling is None or trainer is None:
        return None
    delta = (trainer - sampling).abs()
    keep = batch["completion_mask"].bool() & ~torch.isnan(delta)
    return float(delta[keep].mean()) if keep.any() else 0.0
