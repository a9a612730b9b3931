"""How a bad workbook parameter is reported: where its value came from (a params file, ``-p key=value``, the
default), the parameter, the value and what is allowed; for an unknown name the nearest one (difflib, and the
paper's symbols), never the whole list; no library prefix ("Value error, ")."""

from __future__ import annotations

import difflib
import re
from typing import Any

LIBRARY_PREFIXES = ("Value error, ", "Assertion failed, ")  # pydantic's, before a validator's own message
DEFAULT_ORIGIN = "default"


def plain_message(message: str) -> str:
    """A validator's message without the library's prefix."""
    for prefix in LIBRARY_PREFIXES:
        message = message.removeprefix(prefix)
    return message


# The paper's symbols and common spellings, which are not parameter names.
ALIASES = {
    "gamma": "perception_loss_weight",
    "eta1": "original_entropy_weight",
    "eta2": "masked_entropy_weight",
    "lr": "learning_rate",
    "model": "model_name_or_path",
}


def nearest_names(key: str, fields: dict) -> str:
    """The "did you mean ..." for an unknown parameter name, or where the parameters are listed."""
    names = {name: name for name in fields} | ALIASES
    close = difflib.get_close_matches(key, sorted(names), n=1, cutoff=0.6)
    if close:
        return f"did you mean {names[close[0]]!r}?"
    return "no parameter has a similar name (they are WorkbookParams' fields, papo_nb/workbook/config/params.py)"


def describe_error(error: dict[str, Any], origin_of, fields: dict) -> str:
    """One line for one pydantic error of the workbook params: where the value came from (``origin_of(key)``), the
    parameter, the value and what is allowed, without pydantic's prefix."""
    message = plain_message(error["msg"])
    if not error["loc"]:  # a check across fields (method 'vppo'): its message names them; say where each was set
        named = [n for n in dict.fromkeys(re.findall(r"'(\w+)'", message)) if n in fields]
        where = "; ".join(f"{name} from {origin_of(name)}" for name in named)
        return message + (f" ({where})" if where else "")
    key = ".".join(str(p) for p in error["loc"])
    value, origin = error.get("input"), origin_of(str(error["loc"][0]))
    if error["type"] == "extra_forbidden":
        return f"{origin}: unknown parameter {key!r} (value {value!r}); {nearest_names(key, fields)}"
    field = fields.get(str(error["loc"][0]))
    help_text = f" ({field.description})" if field is not None and field.description else ""
    return f"{origin}: parameter {key!r} = {value!r} is invalid: {message}{help_text}"


def where_set(message: str, origin_of) -> str:
    """``message`` (a later check's, naming ``parameter 'name'``) led by where that value was set, as validation
    errors are; unchanged when it names no parameter."""
    named = re.search(r"parameter '(\w+)'", message)
    return f"{origin_of(named.group(1))}: {message}" if named else message
