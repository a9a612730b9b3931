"""What a reviewer reads first about a run: its results page (``page``) and its learning-signal health (``signal``)."""
