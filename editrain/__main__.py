"""``python -m editrain`` (used with torchrun: ``torchrun ... -m editrain train``)."""

import sys

from editrain.entry import main

sys.exit(main())
