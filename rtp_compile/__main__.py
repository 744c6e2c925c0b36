"""`python -m rtp_compile ...`: the command line of rtp_compile.cli."""
import sys

from rtp_compile.cli import main

sys.exit(main())
