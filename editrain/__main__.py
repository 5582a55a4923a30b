"""``python -m editrain`` (used with torchrun: ``torchrun ... -m editrain train``)."""

import sys

from editrain.cli import main

sys.exit(main())
