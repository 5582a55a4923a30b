"""The ``editrain`` console script and ``python -m editrain``: Ctrl-C handled from the start.

Importing the command line takes about half a second (numpy, tokenizers, the
configuration; torch is imported later, by the commands that need it, inside
:func:`editrain.cli.main`, and never by ``editrain data``); a Ctrl-C in that time used to
end in a KeyboardInterrupt traceback and a death by signal. :func:`main` installs its
handler before anything heavy is imported (this module imports only the standard library's
``os``, ``signal``, ``sys`` and ``time``): a SIGINT while importing prints ``editrain:
interrupted`` and exits 130, as ``editrain train --help`` lists. Once the command line is imported, SIGINT
raises :class:`editrain.spawn.Interrupted` (not ``KeyboardInterrupt``: see
:func:`editrain.spawn.raise_interrupted`) and the command's own handling takes over
(:func:`editrain.cli.main`: stop the workers, then 130).
"""

from __future__ import annotations

import os
import signal
import sys
import time

INTERRUPTED = 130
"""Exit status of a command stopped by Ctrl-C (128 + SIGINT)."""


def _interrupted_while_starting(signum: int, frame: object) -> None:
    """SIGINT before the command line runs: nothing has started that needs stopping."""
    try:
        os.write(2, b"\neditrain: interrupted\n")
    finally:
        os._exit(INTERRUPTED)


def main() -> int:
    """Run ``editrain`` with SIGINT handled while the command line is imported."""
    started_at = time.time()  # before the imports: what a command's end-to-end time counts
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # nohup, a background job
    if not ignored:
        signal.signal(signal.SIGINT, _interrupted_while_starting)
    from editrain.cli import main as cli_main
    from editrain.spawn import Interrupted, raise_interrupted

    if not ignored:
        # Interrupted rather than KeyboardInterrupt: see editrain.spawn.raise_interrupted
        signal.signal(signal.SIGINT, raise_interrupted)
    try:
        return cli_main(started_at=started_at)
    except Interrupted as e:  # before the command's own handling began (argument parsing)
        print(f"\neditrain: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
