"""``python -m collectives.elastic run --np N --min-np M -- CMD``: the restart supervisor."""
import sys

from .supervisor import main

sys.exit(main())
