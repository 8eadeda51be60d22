"""The runtime: compiled-kernel cache, launchers, autograd."""
