import sys

from target_service.main import main

sys.exit(main())
