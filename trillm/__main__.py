"""``python -m trillm`` is the ``trillm`` command."""

import sys

from trillm.entrypoints.cli.main import main

sys.exit(main())
