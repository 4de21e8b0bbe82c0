"""``python -m jaxfuse.export RUN_DIR DIR``: a training run's model as a Hugging Face checkpoint
(see :mod:`jaxfuse.train.export`)."""

import sys

from jaxfuse.train.export import main

if __name__ == "__main__":
  sys.exit(main())
