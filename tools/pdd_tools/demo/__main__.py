import sys

from .site import main

sys.exit(main(sys.argv[1:]))
