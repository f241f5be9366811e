import os
import sys

from . import main

os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
sys.exit(main())
