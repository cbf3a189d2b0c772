"""``python -m trillm.bench serve|latency|throughput`` (same as ``trillm bench ...``)."""

import sys

from trillm.bench.cli import main

sys.exit(main())
