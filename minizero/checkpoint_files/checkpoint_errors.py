"""The two exceptions every checkpoint reader and writer raises: its own module, so that the
folder (checkpoint_folder.py) and each format's reader (dcp_files.py, ...) share them
without importing each other."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded: the message is the one line to print."""


class UnsafeCheckpointError(CheckpointError):
    """A file the allow-list refused: unpickling it would have called code (safe_load.py)."""
