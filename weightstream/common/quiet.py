"""What the ``weightstream`` command keeps off the terminal unless ``-v`` is given.

Megatron-Core, torch and transformers warn at import and at model build about things our user cannot act on
(Apex and Transformer Engine fallbacks, a deprecated default of Megatron's config, CUDA tuning hints on a CPU
job) and draw their own progress bars. The command's entry point calls :func:`quiet_command` once: it filters
those warnings and bars in its own process and, through the environment, in every process it starts (the
fork server, launched ranks, engine workers: interpreters of ours, started after this call). A library user's
process is never touched: nothing here runs on ``import weightstream``.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["quiet_command"]


# Read by every Python interpreter at start: the processes our command starts begin with these filters.
# Only the categories third-party code uses for these notices; weightstream itself reports through its own
# output and errors, never through ``warnings``.
_CHILD_FILTERS = "ignore::UserWarning,ignore::FutureWarning,ignore::DeprecationWarning"


def quiet_command(verbose: bool) -> None:
    """Keep third-party warnings and progress bars off the terminal for this command and the processes it
    starts, unless ``verbose``."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if verbose:
        return
    os.environ["PYTHONWARNINGS"] = _CHILD_FILTERS
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["TRANSFORMERS_VERBOSITY"] = "error"
    for category in (UserWarning, FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category)

