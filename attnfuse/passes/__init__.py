"""The compiler: fuse (recognise and verify) -> tile (choose block sizes) -> lower (flat record) -> plan (a
``KernelSpec`` per kernel: name, tiles, launch spec, and codegen's source on first use)."""
