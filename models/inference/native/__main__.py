"""``python -m models.inference.native``: build (or find) gemflow's C++ kernels and say which paths they take here."""

import sys

from models.inference.native import main

sys.exit(main())
