"""The compiler: ``compiler.compile(graph, config) -> Plan``, its one entry point. fuse (recognise and
verify) -> lower (a flat record; tile chooses its block sizes) -> the plan (``attnfuse/plan.py``: a
``KernelSpec`` per kernel, with name, tiles, launch spec and codegen's source on first use, and the facts a
call needs)."""
