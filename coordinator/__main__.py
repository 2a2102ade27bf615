"""`python -m coordinator`: see coordinator.main."""

import sys

from coordinator.main import main

sys.exit(main())
