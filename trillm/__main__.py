"""``python -m trillm`` is the ``trillm`` command."""

import sys

from trillm.entrypoints.cli import main

sys.exit(main())
