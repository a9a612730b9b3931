"""Every notebook's parameters: the schema and its preflight, the batch arithmetic, model paths and devices."""
