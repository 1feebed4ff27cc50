class CheckpointError(ValueError):
    """A checkpoint or model file that cannot be read or written; the message names the file."""
