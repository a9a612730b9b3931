"""The offline testbed: tiny VLMs built without a hub, the synthetic shapes task and its rewards."""
