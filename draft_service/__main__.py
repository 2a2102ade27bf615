import sys

from draft_service.main import main

sys.exit(main())
