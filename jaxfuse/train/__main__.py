"""``python -m jaxfuse.train``: see :mod:`jaxfuse.train`."""

from jaxfuse.train.cli import main

if __name__ == "__main__":
  raise SystemExit(main())
