"""The grouped layout through a text model that builds its mask from whatever it is given.

Qwen2-VL's and Qwen2.5-VL's text models take a ``{"full_attention": mask}`` dict as it is and hand each layer its
entry, which is how the packed forward delivers its ``GroupedLayout`` (``packed_rows.py``). Qwen3-VL's text model
calls its module's ``create_causal_mask`` on the mask whatever its type; for an attention implementation without a
mask function of its own (``grouped_attention.NAME``) that returns None, and every layer would get no layout. For
the packed forward, ``layout_through_mask_builder`` replaces that module function by one that returns the layout
of such a dict and builds every other mask as before; the model's layers then receive the layout, and keep it in
the keyword arguments each checkpointed layer recomputes with (the mask is built once per forward, never in the
backward).
"""

from __future__ import annotations

import contextlib
import sys

MASK_BUILDER = "create_causal_mask"  # the module function a transformers text model builds its causal mask with
LAYOUT_KEY = "full_attention"  # the dict entry the packed forward's layout travels under


def text_model_module(hf_model):
    """The module that defines ``hf_model``'s text model (Qwen-VL: ``model.language_model``), or None."""
    language_model = getattr(getattr(hf_model, "model", None), "language_model", None)
    return None if language_model is None else sys.modules.get(type(language_model).__module__)


def _layout_or_built(build, layout_type):
    def build_or_pass(*args, **kwargs):
        mask = kwargs["attention_mask"] if "attention_mask" in kwargs else (args[2] if len(args) > 2 else None)
        if isinstance(mask, dict) and isinstance(mask.get(LAYOUT_KEY), layout_type):
            return mask[LAYOUT_KEY]
        return build(*args, **kwargs)

    return build_or_pass


@contextlib.contextmanager
def layout_through_mask_builder(hf_model, layout_type):
    """For the duration: the text model's module builds ``{"full_attention": layout}`` (``layout`` a
    ``layout_type``) into the layout itself, every other mask as before (a module without the builder: unchanged)."""
    module = text_model_module(hf_model)
    build = getattr(module, MASK_BUILDER, None)
    if build is None:
        yield
        return
    setattr(module, MASK_BUILDER, _layout_or_built(build, layout_type))
    try:
        yield
    finally:
        setattr(module, MASK_BUILDER, build)
