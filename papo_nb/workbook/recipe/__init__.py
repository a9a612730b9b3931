"""The paper's recipe: official data and schema, presets, preflight before any weight loads, the official reward."""
