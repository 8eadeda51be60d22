"""``python -m attnfuse.cli``: the ``attnfuse`` command."""

from . import main

if __name__ == "__main__":
    raise SystemExit(main())
