"""``python -m attnfuse.bench``: the ``attnfuse bench`` command on its own."""

from .command import main

raise SystemExit(main())
