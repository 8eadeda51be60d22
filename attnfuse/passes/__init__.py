"""The compiler: fuse (recognise and verify) -> tile (choose block sizes) -> lower (flat record) -> codegen."""
