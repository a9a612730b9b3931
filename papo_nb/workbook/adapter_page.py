"""docs/adapter.md's generated tables: every field ``PAPOGConfig`` declares (name, type, default, help, from the
dataclass), every metric the adapter logs with its meaning (the keys found in the adapter's code), and every
``GRPOTrainer`` method ``PAPOGTrainer`` overrides with what it changes (the class docstring's list).

    python -m papo_nb.workbook.adapter_page          # rewrite the tables in docs/adapter.md
    python -m papo_nb.workbook.adapter_page --check  # exit 1 if the committed page differs

from the repository root (``--root`` names another checkout).

A metric the code logs without a meaning here, or a meaning for a metric the code no longer logs, is an error: the
table cannot fall behind the code.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import MISSING
from pathlib import Path

from trl import GRPOTrainer

from papo_nb.papo import PAPOGTrainer, papo_config, prefill
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.workbook.doc_blocks import replace_block

PAGE = Path("docs") / "adapter.md"  # relative to the root
ADAPTER = Path(papo_config.__file__).parent
SHARING = Path(prefix_sharing.__file__).parent  # prefix sharing, which the adapter builds on, logs its own metrics
# Where the adapter names the metrics it logs: the per-term metrics, the step guard's, the two prefix paths'.
METRIC_SOURCES = ("perception_metrics.py", "step_guard.py")
PROBE_PREFIX = "probe/"  # the in-training probe's evidence, one metric per number (require_gpu_contract_probe)
MEANINGS = {
    "perception_kl": "KL_prcp: token mean of the bounded k3 KL between the policy on the original and on the masked "
    "images (completion tokens, all ranks)",
    "perception_loss": "-perception_kl: the perception term's sign in the loss, before gamma",
    "original_entropy": "H of the policy on the original images (the `entropy_estimator`'s estimate, token mean)",
    "masked_entropy": "H of the policy on the masked images (token mean)",
    "perception_gamma": "gamma this step (`perception_loss_weight`, annealed when the schedule is linear)",
    "papo/gamma_kl": "gamma * KL_prcp: what the perception term subtracts from the loss",
    "papo/original_entropy_term": "eta1 * d_t * H(original): the original-image entropy term as weighted",
    "papo/masked_entropy_term": "eta2 * d_t * H(masked): the masked-image entropy term as weighted",
    "papo/discount": "d_t = gamma_t / gamma_0: the annealing discount of the entropy terms",
    "papo/parent_loss": "the parent GRPOTrainer's loss alone, mean over ranks",
    "papo/vllm_prompt_mismatch_rows": "with vLLM, on a guarded round (the first, then every `vllm_fidelity_every`): "
    "rows whose vLLM prompt ids differ from the trainer's (any stops the run)",
    "papo/vllm_logprob_gap": "with vLLM and TRL's importance-sampling correction, on a guarded round: mean |vLLM "
    "sampling log-prob - trainer log-prob| per completion token (above `vllm_fidelity_logprob_tolerance`: the run "
    "stops)",
    "papo/nonfinite_grad_steps": "optimizer steps skipped so far because the gradient norm was not finite",
    "papo/fp16_overflow_steps": "fp16 steps the gradient scaler skipped for an overflow so far",
    prefill.METRIC: "1 when the masked branch ran as a shared prompt prefix for the batch, 0 for the full forward",
    prefill.SHARE_METRIC: "completions per prefilled prompt on the shared-prefix path (G when a group is whole)",
    prefix_sharing.METRIC: "per log-prob call with `prefix_sharing`: 1 packed by prompt group, 0 the plain forward",
    prefix_sharing.SHARE_METRIC: "completions per packed prompt (`prefix_sharing`)",
    prefix_sharing.COST_METRIC: "predicted packed over plain forward FLOPs per call; above 1 the plain forward ran",
    PROBE_PREFIX + "*": "the gamma-zero probe's evidence (`require_gpu_contract_probe`): passed, gradient "
    "difference against its tolerance, power, per-term leak tests",
}


def logged_metric_keys() -> set[str]:
    """The metric keys the adapter's code names: the string keys of the dicts in ``METRIC_SOURCES`` (and the keys
    they subscript), every ``"papo/..."`` string in the adapter's core, and the probe's prefix."""
    keys: set[str] = {PROBE_PREFIX + "*"}
    core = [p for p in ADAPTER.rglob("*.py") if "probe" not in p.relative_to(ADAPTER).parts]
    core += sorted(SHARING.glob("*.py"))
    for path in core:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r"papo/\w+", node.value)
            ):
                keys.add(node.value)
            if path.name in METRIC_SOURCES and isinstance(node, ast.Dict):
                keys |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return keys


def metrics_markdown() -> str:
    keys = logged_metric_keys()
    if unexplained := keys - set(MEANINGS):
        raise ValueError(f"metrics the adapter logs without a meaning in adapter_page.MEANINGS: {sorted(unexplained)}")
    if stale := set(MEANINGS) - keys:
        raise ValueError(f"adapter_page.MEANINGS explains metrics the adapter no longer logs: {sorted(stale)}")
    lines = ["| metric | meaning |", "|---|---|"]
    return "\n".join(lines + [f"| `{key}` | {MEANINGS[key]} |" for key in MEANINGS]) + "\n"


def _default(field) -> str:
    if field.default is not MISSING:
        return f"`{field.default!r}`"
    return "(factory)" if field.default_factory is not MISSING else "(required)"


def config_markdown() -> str:
    """One row per field PAPOGConfig declares (``papo_config.papo_fields``), in declaration order."""
    lines = ["| field | type | default | help |", "|---|---|---|---|"]
    for field in papo_config.papo_fields():
        choices = field.metadata.get("choices")
        help_text = field.metadata.get("help", "") + (f" Choices: {', '.join(map(repr, choices))}." if choices else "")
        cell_type, help_cell = (text.replace("|", "\\|") for text in (str(field.type), help_text))
        lines.append(f"| `{field.name}` | `{cell_type}` | {_default(field)} | {help_cell} |")
    return "\n".join(lines) + "\n"


def overridden_methods() -> list[str]:
    """The GRPOTrainer methods PAPOGTrainer defines again."""
    return [name for name, obj in vars(PAPOGTrainer).items() if callable(obj) and hasattr(GRPOTrainer, name)]


def overrides_markdown() -> str:
    """The class docstring's "What changes against the parent" list; every override must be in it."""
    doc = PAPOGTrainer.__doc__.split("What changes against the parent:", 1)[1]
    bullets = re.findall(r"^\s*- (.*?)(?=^\s*- |^\s*$)", doc, flags=re.M | re.S)
    bullets = [" ".join(bullet.split()) for bullet in bullets]
    missing = [m for m in overridden_methods() if m != "__init__" and not any(f"``{m}``" in b for b in bullets)]
    if missing:
        raise ValueError(f"PAPOGTrainer overrides {missing} without a line in its docstring's list")
    return "\n".join(f"- {bullet.replace('``', '`')}" for bullet in bullets) + "\n"


BLOCKS = {
    "adapter-config": config_markdown,
    "adapter-metrics": metrics_markdown,
    "adapter-overrides": overrides_markdown,
}


def render(text: str) -> str:
    """``text`` (the page) with every generated block rewritten."""
    for name, make in BLOCKS.items():
        text = replace_block(text, make(), (f"<!-- {name}:start -->", f"<!-- {name}:end -->"))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/adapter.md differs from the code")
    parser.add_argument("--root", type=Path, default=Path("."), help="the repository checkout (default: the cwd)")
    args = parser.parse_args(argv)
    page = args.root / PAGE
    text = page.read_text()
    if args.check:
        if render(text) != text:
            print(f"{page} is stale: python -m papo_nb.workbook.adapter_page", file=sys.stderr)
            return 1
        return 0
    page.write_text(render(text))
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
