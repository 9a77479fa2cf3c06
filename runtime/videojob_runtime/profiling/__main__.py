import sys

from .calibrate import main

sys.exit(main())
