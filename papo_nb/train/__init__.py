"""The training runner behind ``papo-nb train``: run folder, checkpoint integrity, resume, distributed launch."""
