"""AttnFuse's built-in combinators, one module each, registered through the ``attnfuse`` entry points
exactly as a third-party distribution registers its own."""
