"""`python -m rtp_compile ...`: the command line of rtp_compile.apps.cli."""

import sys

from rtp_compile.apps.cli import main

sys.exit(main())
