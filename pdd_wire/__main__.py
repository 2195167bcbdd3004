import sys

from .cli import daemon_main

sys.exit(daemon_main())
