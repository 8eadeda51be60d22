"""Three AttnFuse combinators written against the plugin contract of 2026-11-30 (frozen; see README.md)."""
