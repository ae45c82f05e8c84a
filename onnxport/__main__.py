"""``python -m onnxport``: the same as the ``onnxport`` command."""

import sys

from .cli import main

sys.exit(main())
